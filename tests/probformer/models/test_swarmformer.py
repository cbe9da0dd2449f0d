"""SwarmFormer: window attention, Gumbel routing, top-p writers, tied cluster attention,
gated feedback, the pyramid; padding and lengths that are not multiples of anything."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.deploy import exporter as deploy
from probformer.models.blocks import window_attention
from probformer.models.swarmformer import SwarmConfig, SwarmFormer, _top_fraction
from probformer.training import checkpoint, run_config


def small(**overrides):
    keys = dict(vocab_size=40, width=16, heads=2, layers=3, ffn_width=32, window=2, clusters=8, max_length=64)
    torch.manual_seed(0)
    return SwarmFormer(SwarmConfig(**{**keys, **overrides}))


def padded_batch(lengths, vocab=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    n = max(lengths)
    tokens = torch.randint(0, vocab, (len(lengths), n), generator=generator)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return tokens, mask


# ---- window attention ----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 14),
    left=st.integers(0, 16),
    right=st.integers(0, 16),
    pad=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_window_attention_equals_a_banded_mask(n, left, right, pad, seed):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 2, 3, n, 4, generator=generator, dtype=torch.float64).unbind(0)
    key_bias = torch.zeros(2, n, dtype=torch.float64)
    key_bias[1, max(1, n - pad) :] = float("-inf")
    found = window_attention(q, k, v, key_bias, left, right)
    offset = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    allowed = (offset >= -left) & (offset <= right) & torch.isfinite(key_bias)[:, None, :]  # [B, n, n]
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    expected = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
    real = allowed.any(-1)[:, None, :].expand(2, 3, n)  # queries with a key (padded ones attend to themselves)
    torch.testing.assert_close(found[real], expected[real])
    assert torch.isfinite(found).all()


def test_window_attention_never_wraps_around_the_ends():
    n, w = 10, 3
    q, k, v = (torch.randn(1, 1, n, 4, requires_grad=True) for _ in range(3))
    out = window_attention(q, k, v, torch.zeros(1, n), w, w)
    out[0, 0, n - 1].sum().backward()  # the last token reaches back w tokens, not to the first
    assert k.grad[0, 0, : n - 1 - w].abs().sum() == 0 and v.grad[0, 0, : n - 1 - w].abs().sum() == 0
    assert k.grad[0, 0, n - 1 - w :].abs().sum() > 0


# ---- routing ---------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False])
def test_routing_is_a_distribution_and_the_forward_assignment_one_hot(training):
    model = small()
    model.train(training)
    tokens, mask = padded_batch([13, 7, 1])
    routes = model.diagnostic_trace(tokens, mask)["routing"]
    for layer, route in zip(model.layers, routes):
        probs, assignment = route["probabilities"], route["assignment"]
        assert probs.shape == assignment.shape == (3, 13, layer.clusters)
        assert (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), mask.float())
        assert set(assignment.unique().tolist()) <= {0.0, 1.0}
        torch.testing.assert_close(assignment.sum(-1), mask.float())  # padding is assigned nowhere


def test_gumbel_routing_gradients_are_finite_and_reach_the_router():
    model = small(dropout=0.1)
    model.train()
    tokens, mask = padded_batch([12, 9])
    logits, _ = model(tokens, mask)
    F.cross_entropy(logits[mask], tokens[mask]).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    for layer in model.layers:  # the straight-through assignment carries gradient to the scores
        assert layer.route_query.weight.grad.abs().sum() > 0
        assert layer.cluster_keys.grad.abs().sum() > 0


def test_contiguous_routing_splits_any_length_into_near_equal_chunks():
    model = small(routing="contiguous", clusters=4, pyramid=False).eval()
    tokens, mask = padded_batch([10, 7, 3])
    route = model.diagnostic_trace(tokens, mask)["routing"][0]
    for row, length in enumerate([10, 7, 3]):
        member = route["assignment"][row, :length].argmax(-1)
        assert member.tolist() == [i * 4 // length for i in range(length)]


@given(lengths=st.lists(st.integers(1, 17), min_size=1, max_size=3), clusters=st.integers(1, 6))
@settings(max_examples=20, deadline=None)
def test_contiguous_routing_lets_every_token_write_its_chunks_cluster(lengths, clusters):
    """Fixed chunks give every token confidence 1: with top_p < 1 the writers were the first
    tokens of each sentence, and the later chunks' clusters never saw their tokens. Every
    real token writes (top_p defaults to 1), so every cluster that has members has writers."""
    model = small(routing="contiguous", clusters=clusters, pyramid=False).eval()
    assert model.config.top_p == 1.0
    tokens, mask = padded_batch(lengths)
    for route in model.diagnostic_trace(tokens, mask)["routing"]:
        assert torch.equal(route["writers"], mask)
        members = route["assignment"].sum(1)  # [B, C]
        written = (route["assignment"] * route["writers"][..., None]).sum(1)
        assert torch.equal(members > 0, written > 0)


def test_contiguous_routing_with_fewer_writers_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"'routing'='contiguous' and 'top_p'=0.5: .* use top_p = 1"):
        SwarmConfig(vocab_size=10, routing="contiguous", top_p=0.5)
    assert SwarmConfig(vocab_size=10).top_p == 0.5  # Gumbel routing keeps its default


@pytest.mark.parametrize("top_p", [0.1, 0.5, 1.0])
def test_the_top_p_most_confident_real_tokens_write_to_the_clusters(top_p):
    model = small(top_p=top_p).eval()
    tokens, mask = padded_batch([13, 6, 1])
    for route in model.diagnostic_trace(tokens, mask)["routing"]:
        writers = route["writers"]
        assert not (writers & ~mask).any()
        assert writers.sum(1).tolist() == [math.ceil(top_p * n) for n in (13, 6, 1)]
        confidence = (route["probabilities"] * route["assignment"]).sum(-1)
        for row in range(3):
            chosen, others = confidence[row][writers[row]], confidence[row][mask[row] & ~writers[row]]
            if len(others):
                assert chosen.min() >= others.max()


# ---- cluster attention, feedback, pyramid -------------------------------------------------


def test_cluster_attention_ties_queries_keys_and_values():
    layer = small().layers[0]
    clusters = torch.randn(2, layer.clusters, 16)
    shared = layer.cluster_projection(layer.cluster_norm(clusters)).view(2, layer.clusters, 2, 8).transpose(1, 2)
    scores = shared @ shared.transpose(-1, -2) / math.sqrt(8)  # symmetric: one projection for Q and K
    mixed = (scores.softmax(-1) @ shared).transpose(1, 2).reshape(2, layer.clusters, 16)
    expected = clusters + layer.cluster_out(mixed)
    expected = expected + layer.cluster_ffn(layer.cluster_ffn_norm(expected))
    torch.testing.assert_close(layer.eval().attend_clusters(clusters), expected)
    names = {name for name, _ in layer.named_parameters() if name.startswith("cluster")}
    assert "cluster_projection.weight" in names and not any("qkv" in name for name in names)


def test_feedback_is_gated_and_residual():
    model = small().eval()
    layer = model.layers[0]
    tokens, mask = padded_batch([9, 5])
    x = torch.randn(2, 9, 16)
    bias = torch.zeros(2, 9).masked_fill(~mask, float("-inf"))
    local = layer.local[0](x, bias, window=(2, 2))[0]
    with torch.no_grad():
        layer.feedback_value.weight.zero_()
        layer.feedback_value.bias.zero_()
    out, _ = layer(x, mask, bias)
    torch.testing.assert_close(out, local)  # no feedback value: the residual stream only


@pytest.mark.parametrize(
    "layers,pyramid,expected",
    [(1, True, [8]), (2, True, [8, 4]), (3, True, [8, 4, 2]), (6, True, [8, 8, 4, 4, 2, 2]), (3, False, [8, 8, 8])],
)
def test_pyramid_sizes_are_as_configured(layers, pyramid, expected):
    model = small(layers=layers, pyramid=pyramid)
    assert model.config.cluster_counts() == expected
    assert [layer.cluster_keys.shape[0] for layer in model.layers] == expected
    assert SwarmConfig(vocab_size=5, clusters=2, layers=3).cluster_counts() == [2, 1, 1]


# ---- padding, lengths, dtypes, the trainer ----------------------------------------------


@pytest.mark.parametrize("routing", ["gumbel", "contiguous"])
def test_padding_is_masked_and_lengths_need_not_be_multiples(routing):
    model = small(routing=routing).eval()
    tokens, mask = padded_batch([11, 5])
    with torch.no_grad():
        logits, _ = model(tokens, mask)
        garbage = tokens.masked_fill(~mask, 7)
        longer = torch.cat([garbage, torch.full((2, 4), 3)], 1)
        longer_mask = torch.cat([mask, torch.zeros(2, 4, dtype=torch.bool)], 1)
        again, _ = model(longer, longer_mask)
        alone, _ = model(tokens[1:, :5])
    torch.testing.assert_close(again[:, :11][mask], logits[mask])
    torch.testing.assert_close(alone[0], logits[1, :5])
    assert torch.isfinite(again).all()


def test_bf16_forward_and_backward():
    model = small()
    tokens, mask = padded_batch([10, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens, mask)
    logits.float().sum().backward()
    assert torch.isfinite(logits.float()).all()


def test_trains_through_the_run_config_and_checkpoints(tmp_path):
    config = run_config.RunConfig.from_dict(
        {"model": {"kind": "swarmformer", "width": 16, "heads": 2, "clusters": 4}, "data": {}, "train": {}}
    )
    model = SwarmFormer(config.model_config(vocab_size=30))
    checkpoint.save(model, tmp_path / "ckpt")
    loaded, _ = checkpoint.load(tmp_path / "ckpt")
    tokens, mask = padded_batch([8, 3], vocab=30)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(tokens, mask)[0], model.eval()(tokens, mask)[0])
    assert_close = torch.testing.assert_close
    assert_close(deploy.load(deploy.export(model, tmp_path / "out"))(tokens, mask), model(tokens, mask)[0])


@pytest.mark.parametrize("routing", ["contiguous", "gumbel"])
def test_writers_tie_break_in_position_order(routing):
    """Contiguous routing gives every token confidence 1: the writers are the first
    ceil(p n) real tokens (the rule ONNX's TopK and torch agree on), for any length."""
    from probformer.models.swarmformer import _top_fraction

    for n in (3, 17, 40):
        mask = torch.arange(n)[None, :] < torch.tensor([[n], [n - 2]])
        chosen = _top_fraction(torch.ones(2, n), mask, 0.5)
        for row, real in enumerate((n, n - 2)):
            expected = torch.arange(n) < -(-real // 2)
            assert torch.equal(chosen[row], expected & mask[row])
    confidence = torch.tensor([[0.1, 0.9, 0.5, 0.9]])
    assert _top_fraction(confidence, torch.ones(1, 4, dtype=torch.bool), 0.5).tolist() == [[False, True, False, True]]


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("routing", "random", "routing"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("temperature", 0, "temperature"),
        ("clusters", 0, "clusters"),
        ("window", 0, "window"),
        ("width", 15, "divisible"),
    ],
)
def test_config_errors_name_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        SwarmConfig(vocab_size=10, **{key: value})


@pytest.mark.parametrize("key,value", [("pyramid", "yes"), ("clusters", 2.0), ("routing", 1)])
def test_config_keys_of_the_wrong_type_are_type_errors_naming_the_key(key, value):
    with pytest.raises(TypeError, match=f"config key '{key}' must be of type"):
        SwarmConfig(vocab_size=10, **{key: value})


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.booleans()), min_size=1, max_size=30),
        min_size=1,
        max_size=3,
    ),
    fraction=st.floats(0.01, 1.0),
)
def test_writers_are_the_most_confident_real_tokens(rows, fraction):
    n = max(len(row) for row in rows)
    confidence = torch.zeros(len(rows), n)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, row in enumerate(rows):
        for i, (value, real) in enumerate(row):
            confidence[b, i], mask[b, i] = value, real
        if not mask[b].any():
            mask[b, 0] = True  # every row has a real token
    got = _top_fraction(confidence, mask, fraction)
    for b in range(len(rows)):
        real = [i for i in range(n) if mask[b, i]]
        keep = int(torch.ceil(torch.tensor(fraction) * len(real)))  # the model's own float32 rounding of p * real
        chosen = sorted(real, key=lambda i: (-confidence[b, i].item(), i))[:keep]
        assert got[b].nonzero().flatten().tolist() == sorted(chosen)
