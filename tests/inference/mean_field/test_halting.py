"""ACT and confidence exit (inference.mean_field.halting), by their invariants: halting
weights, remainders and ponder cost, gradients to the halting unit, one traced graph, and
exit at threshold one as the plain engine."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from tests.builders import engine_options_batch as batch
from tests.builders import engine_options_crf as crf

# ---- ACT ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 6),
    st.sampled_from([0.01, 0.1, 0.3]),
    st.sampled_from(["posterior", "delta"]),
    st.floats(-3, 3),
)
def test_act_halting_weights_remainders_and_ponder_cost(seed, iterations, epsilon, source, bias):
    engine = inference.MeanField(
        crf(seed=seed), iterations=iterations, halting="act", halting_source=source, act_epsilon=epsilon
    )
    with torch.no_grad():
        engine.halting_unit.bias.fill_(bias)  # from "halt at once" to "never halt"
    tokens, mask = batch(seed)
    posterior = engine(tokens, mask)
    halting, nodes = posterior.halting, engine.crf.node_mask(mask)
    weights = halting["weights"]  # [T, B, N]
    assert weights.shape[0] == iterations and (weights >= 0).all()
    assert torch.allclose(weights.sum(0)[nodes], torch.ones(()), atol=1e-6)  # one per node
    assert (weights[:, ~nodes] == 0).all()
    assert (halting["remainder"][nodes] >= epsilon - 1e-6).all()  # R = 1 - sum_{t<N} p_t > epsilon
    updates = halting["updates"]
    assert torch.equal(updates, updates.round()) and ((updates[nodes] >= 1) & (updates[nodes] <= iterations)).all()
    assert torch.equal(halting["ponder"], updates + halting["remainder"])  # N(t) + R(t)
    # the weights stop at N(t), the output is the weighted mixture of the iterations' logits
    steps = torch.arange(1, iterations + 1)[:, None, None]
    assert (weights[steps > updates[None]] == 0).all()
    mixture = sum(w[..., None] * h for w, h in zip(weights, posterior.history))
    assert torch.allclose(posterior.logits, mixture * nodes[..., None], atol=1e-6)
    # a halted node's logits are frozen
    for t in range(1, iterations):
        halted = (updates < t + 1) & nodes
        assert torch.equal(posterior.history[t][halted], posterior.history[t - 1][halted])


def test_act_gradients_reach_the_halting_unit():
    engine = inference.MeanField(crf(), iterations=4, halting="act")
    tokens, mask = batch()
    posterior = engine(tokens, mask)
    (posterior.logits.square().sum() + posterior.halting["ponder"].sum()).backward()
    gradient = engine.halting_unit.weight.grad
    assert gradient is not None and torch.isfinite(gradient).all() and gradient.abs().sum() > 0


def test_halting_forward_has_no_data_dependent_control_flow():
    """torch.export traces the ACT and exit forward passes into one graph that gives the
    eager results on another batch."""

    class Logits(torch.nn.Module):
        def __init__(self, engine, exit_confidence):
            super().__init__()
            self.engine, self.exit_confidence = engine, exit_confidence

        def forward(self, tokens, mask):
            confidence = (lambda logits: logits.softmax(-1).amax(-1)) if self.exit_confidence else None
            return self.engine(tokens, mask, confidence=confidence).logits

    for halting in ("act", "exit"):
        module = Logits(inference.MeanField(crf(), iterations=3, halting=halting, exit_threshold=0.3), True).eval()
        program = torch.export.export(module, batch(0))
        tokens, mask = batch(1)
        with torch.no_grad():
            assert torch.allclose(program.module()(tokens, mask), module(tokens, mask), atol=1e-6)


# ---- confidence exit ------------------------------------------------------------------


def test_exit_at_threshold_one_is_the_plain_engine_and_low_thresholds_stop_at_once():
    tokens, mask = batch()
    plain = inference.MeanField(crf(), iterations=4).eval()
    exiting = inference.MeanField(crf(), iterations=4, halting="exit", exit_threshold=1.0).eval()
    confidence = lambda logits: logits.softmax(-1).amax(-1)  # noqa: E731
    never = exiting(tokens, mask, confidence=confidence)
    assert torch.equal(never.logits, plain(tokens, mask).logits)
    assert (never.halting["updates"][exiting.crf.node_mask(mask)] == 4).all()
    exiting.exit_threshold = 1e-9
    at_once = exiting(tokens, mask, confidence=confidence)
    nodes = exiting.crf.node_mask(mask)
    assert (at_once.halting["updates"][nodes] == 1).all()
    assert torch.equal(at_once.logits, at_once.history[0] * nodes[..., None])
    exiting.train()  # exit is an inference rule: training runs every iteration
    assert exiting(tokens, mask, confidence=confidence).halting is None


def test_exit_at_inference_without_a_confidence_is_refused_and_false_runs_every_iteration():
    """No confidence means no token can exit: it ran silently as halting="none"."""
    tokens, mask = batch()
    plain = inference.MeanField(crf(), iterations=4).eval()
    exiting = inference.MeanField(crf(), iterations=4, halting="exit", exit_threshold=1e-9).eval()
    with pytest.raises(ValueError, match=r"halting='exit' at inference needs confidence="):
        exiting(tokens, mask)
    assert torch.equal(exiting(tokens, mask, confidence=False).logits, plain(tokens, mask).logits)
    exiting.train()  # training runs every iteration: nothing to refuse
    assert torch.equal(exiting(tokens, mask).logits, plain.train()(tokens, mask).logits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_engines_own_parameters_follow_the_crfs_dtype(dtype):
    """ACT's halting unit and the span were float32 on a float64 CRF: ACT failed with a dtype
    mismatch and the span prior was computed from a float32 span."""
    field = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=2).to(dtype)
    tokens = torch.tensor([[1, 2, 3, 4]])
    act = inference.MeanField(field, iterations=3, halting="act")
    span = inference.MeanField(field, iterations=3, span=True, span_max=4, span_ramp=2)
    assert {p.dtype for p in [*act.parameters(), *span.parameters()]} == {dtype}
    assert act(tokens).logits.dtype == dtype
    prior = span.span_prior(4, 4)  # every span at its maximum 4: m(x) = clamp((2 + 4 - x) / 2, 0, 1)
    distance = (torch.arange(4)[None, :] - torch.arange(4)[:, None]).abs().to(dtype)
    expected = ((2 + 4 - distance) / 2).clamp(1e-6, 1).log()
    assert prior.dtype == dtype and torch.equal(prior[0], expected)
