"""The shared heads (inference.mean_field.kernels.shared_heads) equal their definition written
with plain operators, and the fused kernel with the shared form's bias equals the naive one."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inference
from tests.builders import assert_grads_close as _assert_grads_close
from tests.builders import assert_outputs_close as _assert_outputs_close
from tests.builders import padded_token_batch as batch
from tests.builders import shared_crf
from tests.builders import weighted_loss as _weighted_loss
from tests.oracles import explicit_null_softmax as _explicit_null_softmax
from tests.strategies import HEAD_PROBLEMS

pytestmark = pytest.mark.usefixtures("keep_global_rng")


# random head-logit problems: sentences of n nodes, logits up to ~scale, a share of illegal arcs


@settings(max_examples=60, deadline=None)
@given(
    **HEAD_PROBLEMS,
    additive=st.booleans(),
    outputs=st.sets(st.sampled_from(["probs", "lse", "forward", "reverse"]), min_size=1),
)
def test_shared_heads_equal_the_definition(seed, n, scale, illegal, additive, outputs):
    """The shared form's kernel (one sentence at a time, logits in log2 units, backward
    written out) against the definition written with plain operators: logits scale q_i . k_j
    + additive[c, i, j] on the legal arcs, the softmax over them and a null column, the
    messages P V and P^T V_rev; values and gradients of any subset of the outputs, float64.
    (The log2 scaling rounds the logits once more: rtol 1e-10 at logits ~1e3.)"""
    from inference.mean_field.kernels.shared_heads import shared_heads

    generator = torch.Generator().manual_seed(seed)
    B, C, r = 2, 3, 4
    projections = [torch.randn(B, n, C, r, generator=generator, dtype=torch.float64) for _ in range(4)]
    bias = torch.randn(C, n, n, generator=generator, dtype=torch.float64) if additive else None
    arcs = torch.rand(B, n, n, generator=generator) >= illegal
    names = ["probs", "lse", "forward", "reverse"]
    shapes = [(B, C, n, n), (B, C, n), (B, n, C, r), (B, n, C, r)]
    weights = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]

    def truth(query, key, bias, value, value_rev):
        logits = scale * torch.einsum("bicr,bjcr->bcij", query, key)
        logits = logits if bias is None else logits + bias
        probs, lse = _explicit_null_softmax(logits.masked_fill(~arcs[:, None], -math.inf), arcs.any(-1))
        forward = torch.einsum("bcij,bjcr->bicr", probs, value)
        return probs, lse, forward, torch.einsum("bcji,bjcr->bicr", probs, value_rev)

    def leaves():
        return [None if t is None else t.clone().requires_grad_() for t in (*projections[:2], bias, *projections[2:])]

    true_inputs, mine = leaves(), leaves()
    expected = truth(*true_inputs)
    _weighted_loss(expected, names, weights, outputs).backward()
    query, key, additive_bias, value, value_rev = mine
    results = shared_heads(query, key, scale, additive_bias, arcs, value, value_rev)
    _weighted_loss(results, names, weights, outputs).backward()
    _assert_outputs_close(results, expected, rtol=1e-10, atol=1e-12)
    _assert_grads_close(mine, true_inputs, rtol=1e-9, atol=1e-11)
    with torch.no_grad():  # the no-grad path is the same forward
        again = shared_heads(*projections[:2], scale, bias, arcs, *projections[2:])
    _assert_outputs_close(again, expected, rtol=1e-10, atol=1e-12)


def test_shared_heads_refuses_a_tensor_scale_and_a_second_derivative():
    """The scale is a constant of the kernel (a tensor would silently get no gradient), and
    the written-out backward is differentiable once: both refused by name."""
    from inference.mean_field.kernels.shared_heads import shared_heads

    q, k, v, vr = (torch.randn(1, 3, 2, 2, dtype=torch.float64, requires_grad=True) for _ in range(4))
    arcs = torch.ones(1, 3, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="scale must be a Python number"):
        shared_heads(q, k, torch.tensor(0.5), None, arcs, v, vr)
    lse = shared_heads(q, k, 0.5, None, arcs, v, vr)[1]
    (grad,) = torch.autograd.grad(lse.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        torch.autograd.grad(grad.sum(), k)


def outputs(engine, tokens, mask):
    """The label marginals, the ELBO, and every parameter's gradient of a loss reading both."""
    posterior = engine(tokens, mask)
    probe = torch.randn(posterior.z.shape, generator=torch.Generator().manual_seed(1), dtype=posterior.z.dtype)
    loss = (posterior.logits * probe).sum() + posterior.elbo.sum()
    grads = torch.autograd.grad(loss, list(engine.crf.parameters()))
    return posterior.logits, posterior.elbo, grads


CASES = [  # (topology, schedule, global labels)
    ("full", "async", 0),
    ("full", "parallel", 0),
    ("full | root()", "macaron", 2),
    ("star()", "async", 2),
    ("window(2) | root()", "parallel", 0),
]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("topology, schedule, global_labels", CASES)
def test_fused_equals_naive_with_bias(topology, schedule, global_labels, dtype, tolerance):
    crf = shared_crf(labels=4, rank=3, gamma=2, topology=topology, global_labels=global_labels).to(dtype)
    tokens, mask = batch(length=11)
    found = {}
    for kernel in ("naive", "fused"):
        engine = inference.MeanField(crf, iterations=3, schedule=schedule, kernel=kernel, weights="reference")
        found[kernel] = outputs(engine, tokens, mask)
    (logits, elbo, grads), (logits_f, elbo_f, grads_f) = found["naive"], found["fused"]
    torch.testing.assert_close(logits_f, logits, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(elbo_f, elbo, atol=tolerance * 10, rtol=tolerance)
    for grad, grad_f in zip(grads, grads_f):
        torch.testing.assert_close(grad_f, grad, atol=tolerance * 10, rtol=tolerance)
