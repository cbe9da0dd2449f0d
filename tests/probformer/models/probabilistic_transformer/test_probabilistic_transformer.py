import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probformer as pf
from tests.reference_pt import reference_logits


def small(**overrides):
    values = dict(vocab_size=30, labels=8, channels=2, rank=4, iterations=3, dropout=0.0)
    values.update(overrides)
    return pf.PTConfig(**values)


@settings(max_examples=15)
@given(n=st.integers(2, 10), seed=st.integers(0, 1000))
def test_mlm_outputs_reproduce_the_reference_pt(n, seed):
    torch.manual_seed(seed)
    model = pf.ProbabilisticTransformer(small()).double().eval()
    tokens = torch.randint(0, 30, (3, n))
    mask = torch.arange(n)[None] < torch.randint(2, n + 1, (3,))[:, None]
    with torch.no_grad():
        ours, _ = model(tokens, mask)
        crf = model.crf
        U, V = crf.ternary_u.permute(0, 2, 3, 1), crf.ternary_v.permute(0, 2, 3, 1)
        expected = model.head.decoder(reference_logits(crf.unary[tokens], mask, U, V, 3, 8))
    assert ours.shape == (3, n, 30)
    torch.testing.assert_close(ours[mask], expected[mask], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "overrides,shape",
    [
        (dict(task="tagging", num_classes=5), (2, 7, 5)),
        (dict(task="classification", num_classes=3), (2, 3)),
        (dict(task="classification", num_classes=3, pooling="root", topology="full | root()"), (2, 3)),
        (dict(global_labels=6, topology="window(2) | star()"), (2, 7, 30)),
        (dict(mup=True, schedule="parallel"), (2, 7, 30)),
    ],
)
def test_tasks_and_options_give_finite_outputs_and_gradients(overrides, shape):
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(small(dropout=0.1, **overrides)).train()
    tokens = torch.randint(0, 30, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 1:] = False  # a length-1 sentence: no legal head anywhere in it
    out, posterior = model(tokens, mask)
    assert out.shape == shape and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.isfinite(posterior.elbo).all()


def test_classification_by_root_reads_the_root_node():
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(
        small(task="classification", num_classes=2, pooling="root", topology="full | root()")
    ).eval()
    tokens = torch.randint(0, 30, (1, 5))
    out, posterior = model(tokens)
    torch.testing.assert_close(out, model.head.decoder(posterior.logits[:, 5]))


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(0, 1000), st.sampled_from(["star()", "clusters(2)", "star() | clusters(2)"]))
def test_classification_by_root_reads_root_wherever_the_topology_lists_it(n, seed, others):
    """The same graph with ROOT first or last among the virtual nodes (the same weights): the
    ROOT's marginals, so the class logits, do not depend on the order; the other virtual
    nodes' do differ from ROOT's, so reading one of them instead would show."""
    torch.manual_seed(seed)
    first, last = (
        pf.ProbabilisticTransformer(small(task="classification", num_classes=3, pooling="root", topology=topology))
        .double()
        .eval()
        for topology in (f"root() | {others}", f"{others} | root()")
    )
    last.load_state_dict(first.state_dict())
    tokens = torch.randint(0, 30, (2, n))
    with torch.no_grad():
        out_first, posterior = first(tokens)
        out_last, _ = last(tokens)
        virtual = len(first.crf.topology.virtual)
        others_read = [first.head.decoder(posterior.logits[:, n + k]) for k in range(1, virtual)]
    assert first.crf.topology.virtual[0] == "root" and last.crf.topology.virtual[-1] == "root"
    torch.testing.assert_close(out_last, out_first, atol=1e-10, rtol=1e-10)
    assert all((out_first - other).abs().max() > 1e-6 for other in others_read)


@pytest.mark.parametrize(
    "values,match",
    [
        (dict(vocab_size=10, labels=0), "'labels' must be an integer >= 1"),
        (dict(vocab_size=10, task="lm"), "'task' must be one of"),
        (dict(vocab_size=10, task="tagging"), "'num_classes' must be >= 1"),
        (dict(vocab_size=10, pooling="root", task="classification", num_classes=2), "needs a ROOT node"),
        (dict(vocab_size=10, layers=3), r"unknown config keys \['layers'\]"),
        (dict(vocab_size=10, pairwise_gamma=2), r"'pairwise_gamma' \(2\) is the Pairwise factor's distance clip"),
    ],
)
def test_config_validation_names_the_key(values, match):
    with pytest.raises(ValueError, match=match):
        pf.PTConfig.from_dict(values)


@pytest.mark.parametrize(
    "values,match",
    [
        (dict(vocab_size=10, iterations=2.0), "'iterations' must be of type int"),
        (dict(vocab_size="10"), "'vocab_size' must be of type int"),
        (dict(vocab_size=10, gamma=1.5), "'gamma' must be of type"),
        (dict(vocab_size=10, pairwise=3), "'pairwise' must be of type"),
    ],
)
def test_a_key_of_the_wrong_type_is_a_type_error_naming_the_key(values, match):
    with pytest.raises(TypeError, match=match):
        pf.PTConfig.from_dict(values)


def test_bad_tokens_are_refused():
    model = pf.ProbabilisticTransformer(small())
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, 30]]))


@pytest.mark.slow  # ~9 s compile; see tests/test_compile.py (slow)
def test_compiled_model_equals_eager():
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(small(kernel="fused")).eval()
    tokens = torch.randint(0, 30, (2, 12))
    compiled = torch.compile(lambda t: model(t)[0], fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens)[0], atol=1e-5, rtol=1e-5)
