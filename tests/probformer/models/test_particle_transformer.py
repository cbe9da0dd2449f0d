import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import probformer as pf
from probformer.models.particle_transformer import RESAMPLERS, ParticleConfig, ParticleTransformer, draw_ancestors

FORMAT_FILES = {"torch": "model", "exported": "model.pt2", "onnx": "model.onnx"}


def small(**overrides):
    values = dict(
        vocab_size=40, width=32, heads=4, layers=4, ffn_width=64, max_length=32, dropout=0.0, resample_every=2
    )
    values.update(overrides)
    return ParticleConfig(**values)


def test_shapes_and_trace():
    torch.manual_seed(0)
    model = ParticleTransformer(small()).train()
    tokens = torch.randint(0, 40, (3, 9))
    logits, trace = model(tokens)
    assert logits.shape == (3, 9, 40)
    assert trace["log_weights"].shape == (4, 3, 9) and trace["ess"].shape == (4, 3)
    assert ((trace["ess"] > 0) & (trace["ess"] <= 1 + 1e-5)).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("threshold", ["median", 1.0])
def test_resampling_triggers_exactly_when_ess_falls_below_the_threshold(threshold):
    torch.manual_seed(1)
    tokens = torch.randint(0, 40, (8, 12))

    def run(value):
        torch.manual_seed(1)
        model = ParticleTransformer(small(ess_threshold=value, layers=6)).train()
        with torch.no_grad():
            for block in model.blocks:
                block.qkv.weight.mul_(4.0)  # peaked attention: degenerate weights
        model.generator = torch.Generator().manual_seed(0)
        return model(tokens)[1]

    if threshold == "median":  # ESS at the first resampling layer does not depend on the threshold
        threshold = run(0.0)["ess"][1].median().item() + 1e-6
    trace = run(threshold)
    # the recorded weights are the ones the decision read (before the reset): ESS = (sum w)^2 / sum w^2
    w = (trace["log_weights"].double() - trace["log_weights"].double().amax(-1, keepdim=True)).exp()
    by_hand = w.sum(-1) ** 2 / w.square().sum(-1) / 12
    assert torch.allclose(by_hand, trace["ess"].double(), atol=1e-5)
    for layer in range(6):
        if (layer + 1) % 2 == 0:
            expected = torch.ones(8, dtype=torch.bool) if threshold >= 1 else trace["ess"][layer] < threshold
            assert torch.equal(trace["resampled"][layer], expected)
        else:
            assert not trace["resampled"][layer].any()
    if threshold < 1:
        assert trace["resampled"][1].any() and not trace["resampled"][1].all()  # both branches exercised


def test_padding_does_not_change_real_tokens_in_eval():
    torch.manual_seed(2)
    model = ParticleTransformer(small(ess_threshold=1.0)).eval()
    tokens = torch.randint(0, 40, (1, 6))
    padded = torch.cat([tokens, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    a, _ = model(tokens)
    b, _ = model(padded, mask)
    torch.testing.assert_close(a, b[:, :6], atol=1e-5, rtol=1e-5)


def test_deterministic_under_a_fixed_generator():
    torch.manual_seed(3)
    model = ParticleTransformer(small(ess_threshold=1.0, jitter=0.1)).train()
    tokens = torch.randint(0, 40, (2, 8))
    model.generator = torch.Generator().manual_seed(5)
    a, _ = model(tokens)
    model.generator = torch.Generator().manual_seed(5)
    b, _ = model(tokens)
    model.generator = torch.Generator().manual_seed(6)
    c, _ = model(tokens)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("resampling", ["straight-through", "gumbel-softmax"])
def test_relaxations_pass_finite_gradients(resampling):
    torch.manual_seed(4)
    model = ParticleTransformer(small(ess_threshold=1.0, resampling=resampling)).train()
    logits, _ = model(torch.randint(0, 40, (2, 8)))
    logits.logsumexp(-1).sum().backward()
    grad = model.resample_value.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_classification_head():
    model = ParticleTransformer(small(task="classification", num_classes=3))
    logits, _ = model(torch.randint(0, 40, (2, 5)))
    assert logits.shape == (2, 3)


@pytest.mark.parametrize(
    "values,match",
    [
        (dict(vocab_size=10, width=30, heads=4), "divisible"),
        (dict(vocab_size=10, resample_every=0), "'resample_every'"),
        (dict(vocab_size=10, ess_threshold=2.0), "'ess_threshold'"),
        (dict(vocab_size=10, resampling="soft"), "'resampling'"),
        (dict(vocab_size=10, depth=3), r"unknown config keys \['depth'\]"),
    ],
)
def test_bad_config(values, match):
    with pytest.raises(ValueError, match=match):
        ParticleConfig.from_dict(values)


def test_bad_tokens():
    model = ParticleTransformer(small())
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="max_length"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("resampling", ["mix", pytest.param("copy", marks=pytest.mark.slow)])
def test_compiled_model_equals_eager(resampling):
    torch.manual_seed(5)
    model = ParticleTransformer(small(ess_threshold=0.5, resampling=resampling)).eval()
    tokens = torch.randint(0, 40, (2, 10))
    compiled = torch.compile(lambda t: model(t)[0], fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens)[0], atol=1e-5, rtol=1e-5)


def test_exported_from_the_package():
    assert pf.ParticleTransformer is ParticleTransformer and math.isfinite(1.0)


# ---- resampling="copy": literal SMC resampling --------------------------------

# weights written by hand on a row with padding in the middle; n = 6 real tokens
HAND_MASK = torch.tensor([True, True, False, True, True, True, True, False])


HAND_WEIGHTS = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625, 0.0, 0.0])  # slot 6 is real, weight 0


def hand_log_weights(rows):
    return HAND_WEIGHTS.log().expand(rows, -1).clone(), HAND_MASK.expand(rows, -1).clone()


def offspring(ancestors, mask):
    """counts[b, j] = #{real slots i of row b with a(i) = j}, by a loop."""
    counts = torch.zeros(ancestors.shape, dtype=torch.long)
    for b in range(ancestors.shape[0]):
        for i in range(ancestors.shape[1]):
            if mask[b, i]:
                counts[b, ancestors[b, i]] += 1
    return counts


@pytest.mark.parametrize("resampler", RESAMPLERS)
def test_offspring_counts_have_expectation_n_w(resampler):
    rows = 4000
    log_weights, mask = hand_log_weights(rows)
    ancestors = draw_ancestors(log_weights, mask, resampler, torch.Generator().manual_seed(0))
    counts = torch.zeros(rows, 8).scatter_add_(1, ancestors, mask.float())  # padded slots add 0
    assert torch.equal(counts[:50], offspring(ancestors[:50], mask[:50]).float())  # the fast count is the loop's
    expected = 6 * HAND_WEIGHTS.double()  # [3, 1.5, 0, 0.75, 0.375, 0.375, 0, 0]
    mean = counts.double().mean(0)
    bound = 5 * (6 * HAND_WEIGHTS.double() * (1 - HAND_WEIGHTS.double()) / rows).sqrt()  # multinomial sd: the widest
    assert ((mean - expected).abs() <= bound + 1e-12).all(), (mean, expected)
    assert (counts[:, ~HAND_MASK] == 0).all() and (counts[:, 6] == 0).all()  # padded and weight-0 tokens die
    assert (counts.sum(1) == 6).all()
    if resampler != "multinomial":  # stratified/systematic: the heaviest token (n w = 3) gets 2..4 copies
        assert counts[:, 0].min() >= 2 and counts[:, 0].max() <= 4


@given(
    weights=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12).filter(lambda w: sum(w) > 1e-3),
    seed=st.integers(0, 2**31),
    deterministic=st.booleans(),
)
def test_systematic_counts_are_floor_or_ceil_of_n_w(weights, seed, deterministic):
    w = torch.tensor(weights, dtype=torch.float64)
    mask = torch.ones(1, len(weights), dtype=torch.bool)
    ancestors = draw_ancestors(w.log()[None], mask, "systematic", torch.Generator().manual_seed(seed), deterministic)
    counts = offspring(ancestors, mask)[0].double()
    target = len(weights) * w / w.sum()
    assert ((counts >= target.floor() - 1e-9) & (counts <= target.ceil() + 1e-9)).all(), (counts, target)
    assert (counts[w == 0] == 0).all()


def copy_inputs(seed=0, B=3, n=7, D=32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, D, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, [0, 3]] = False
    log_weights = (2 * torch.randn(B, n, generator=generator, dtype=torch.float64)).masked_fill(~mask, -math.inf)
    return x, log_weights.requires_grad_(), mask


def copy_model(**overrides):
    torch.manual_seed(0)
    values = dict(resampling="copy", ess_threshold=1.0, resampler="multinomial")
    values.update(overrides)
    return ParticleTransformer(small(**values)).double().train()


def test_a_resampled_token_equals_its_ancestor_plus_its_slots_position():
    x, log_weights, mask = copy_inputs()
    model = copy_model()
    model.generator = torch.Generator().manual_seed(1)
    active = torch.tensor([True, True, False])
    out, ancestors = model.resample_copy(x, log_weights, mask, active)
    position = model.position.weight
    copies = 0
    for b in range(3):
        for i in range(7):
            a = ancestors[b, i].item()
            if active[b] and mask[b, i]:
                assert mask[b, a]  # ancestors are real tokens of the same row
                assert torch.equal(out[b, i], x[b, a] + position[i])
                copies += a != i
            else:  # inactive rows and padded slots: untouched
                assert a == i and torch.equal(out[b, i], x[b, i])
    assert copies > 0


def test_the_estimator_is_straight_through_with_a_baseline_by_hand():
    """d/dl_k of sum_i g_i . x_new_i = sum_i g_i . (x_a(i) - xbar) (1[a(i) = k] - w_k) on active rows;
    d/dx_j = sum over the slots that copy j of g_i (on untouched slots: g_j)."""
    x, log_weights, mask = copy_inputs(seed=3)
    model = copy_model()
    model.generator = torch.Generator().manual_seed(2)
    active = torch.tensor([True, True, False])
    out, ancestors = model.resample_copy(x, log_weights, mask, active)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (out * g).sum().backward()
    for b in range(3):
        real = [j for j in range(7) if mask[b, j]]
        z = sum(math.exp(log_weights[b, j].item()) for j in real)
        w = {j: math.exp(log_weights[b, j].item()) / z for j in real}
        xbar = sum(w[j] * x[b, j].detach() for j in real)
        for k in range(7):
            expected = 0.0
            if active[b] and mask[b, k]:
                for i in real:
                    a = ancestors[b, i].item()
                    expected += float(g[b, i] @ (x[b, a].detach() - xbar)) * ((a == k) - w[k])
            assert log_weights.grad[b, k].item() == pytest.approx(expected, abs=1e-10)
            copied_by = [i for i in range(7) if active[b] and mask[b, i] and ancestors[b, i] == k]
            untouched = not (active[b] and mask[b, k])
            expected_x = sum((g[b, i] for i in copied_by), torch.zeros(32, dtype=torch.float64)) + g[b, k] * untouched
            torch.testing.assert_close(x.grad[b, k], expected_x, atol=1e-12, rtol=0)
    assert torch.isfinite(log_weights.grad).all() and log_weights.grad[active].abs().sum() > 0


def test_the_estimator_is_unbiased_for_the_gradient_of_the_soft_copy():
    """Over multinomial draws, E[d/dl_k g . x_new_i] = g . w_k (x_k - xbar): the gradient of g . xbar."""
    rows, n, D = 20000, 4, 32
    generator = torch.Generator().manual_seed(5)
    x0 = torch.randn(n, D, dtype=torch.float64, generator=generator)
    l0 = torch.tensor([0.3, -1.0, 1.2, 0.0], dtype=torch.float64)
    g = torch.randn(D, dtype=torch.float64, generator=generator)
    model = copy_model()
    model.generator = torch.Generator().manual_seed(6)
    log_weights = l0.expand(rows, n).clone().requires_grad_()
    mask = torch.ones(rows, n, dtype=torch.bool)
    out, _ = model.resample_copy(x0.expand(rows, n, D), log_weights, mask, torch.ones(rows, dtype=torch.bool))
    (out[:, 0] @ g).sum().backward()  # slot 0's copy
    per_row = log_weights.grad
    w = l0.softmax(0)
    xbar = w @ x0
    exact = w * ((x0 - xbar) @ g)
    sd = per_row.std(0) / math.sqrt(rows)
    assert ((per_row.mean(0) - exact).abs() <= 5 * sd).all(), (per_row.mean(0), exact)


@pytest.mark.parametrize("resampler", RESAMPLERS)
def test_copy_passes_finite_nonzero_gradients_through_the_whole_model(resampler):
    torch.manual_seed(4)
    model = ParticleTransformer(small(ess_threshold=1.0, resampling="copy", resampler=resampler)).train()
    tokens = torch.randint(0, 40, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 6:] = False
    logits, trace = model(tokens, mask)
    assert trace["resampled"][[1, 3]].all() and not trace["resampled"][[0, 2]].any()
    logits.logsumexp(-1)[mask].sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    assert grads["blocks.0.qkv.weight"].abs().sum() > 0
    assert "resample_value.weight" not in grads  # copy has no parameters of its own


def test_no_resampling_above_the_threshold_equals_the_no_resampling_path():
    tokens = torch.randint(0, 40, (8, 12), generator=torch.Generator().manual_seed(7))

    def run(**overrides):
        torch.manual_seed(1)
        model = ParticleTransformer(small(layers=2, **overrides)).train()  # one resampling layer
        with torch.no_grad():
            for block in model.blocks:
                block.qkv.weight.mul_(4.0)  # peaked attention: ESS differs between sentences
        model.generator = torch.Generator().manual_seed(0)
        return model(tokens)

    plain, plain_trace = run(resampling="none")
    threshold = plain_trace["ess"][1].median().item() + 1e-6  # ESS at the first resampling layer
    logits, trace = run(resampling="copy", ess_threshold=threshold)
    resampled = trace["resampled"].any(0)
    assert torch.equal(trace["resampled"][1], plain_trace["ess"][1] < threshold)
    assert resampled.any() and not resampled.all()
    assert torch.equal(logits[~resampled], plain[~resampled])  # the same computation, bit for bit
    assert not torch.equal(logits[resampled], plain[resampled])
    assert not plain_trace["resampled"].any()


def test_copy_padding_does_not_change_real_tokens_in_eval():
    torch.manual_seed(2)
    model = ParticleTransformer(small(ess_threshold=1.0, resampling="copy")).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.weight.mul_(4.0)  # peaked attention: uneven weights, so copies happen
    tokens = torch.randint(0, 40, (1, 12))
    padded = torch.cat([tokens, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[True] * 12 + [False] * 3])
    (a, trace_a), (b, trace_b) = model(tokens), model(padded, mask)
    torch.testing.assert_close(a, b[:, :12], atol=1e-5, rtol=1e-5)
    assert torch.equal(trace_a["ancestors"], trace_b["ancestors"][..., :12])
    assert torch.equal(trace_b["ancestors"][..., 12:], torch.arange(12, 15).expand(4, 1, 3))
    assert (trace_a["ancestors"][[1, 3]] != torch.arange(12)).any()  # a real resampling happened


def test_old_resampling_values_load_as_mix():
    config = ParticleConfig.from_dict(dict(vocab_size=10, resampling="gumbel-softmax"))
    assert (config.resampling, config.relaxation) == ("mix", "gumbel-softmax")
    assert ParticleConfig.from_dict(config.to_dict()) == config
    assert ParticleConfig.from_dict(dict(vocab_size=10)).resampling == "mix"  # configs without the key
    old = ParticleTransformer(small(resampling="straight-through"))
    loaded = ParticleTransformer(small(resampling="mix")).load_state_dict(old.state_dict())  # strict
    assert not loaded.missing_keys and not loaded.unexpected_keys


@pytest.mark.parametrize(
    "values,match",
    [
        (dict(resampler="residual"), "'resampler' must be one of"),
        (dict(relaxation="hard"), "'relaxation' must be one of"),
        (dict(resampling="gumbel-softmax", relaxation="straight-through"), None),
        (dict(resampling="straight-through", relaxation="gumbel-softmax"), "contradicts 'relaxation'"),
        (dict(resampling="systematic"), "'resampling' must be one of \\['copy', 'mix', 'none'\\]"),
        (dict(layers=2, resample_every=3), "'resample_every' \\(3\\) exceeds 'layers' \\(2\\): the model would never"),
        (dict(layers=2, resample_every=3, resampling="none"), None),
        (dict(layers=2, resample_every=2, resampling="copy"), None),
    ],
)
def test_bad_resampling_config(values, match):
    if match is None:
        ParticleConfig(vocab_size=10, **values)
        return
    with pytest.raises(ValueError, match=match):
        ParticleConfig(vocab_size=10, **values)


def test_draw_ancestors_refuses_an_unknown_resampler():
    with pytest.raises(ValueError, match="resampler must be one of"):
        draw_ancestors(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), "residual")


@pytest.mark.parametrize(
    "format", ["torch", pytest.param("exported", marks=pytest.mark.slow), pytest.param("onnx", marks=pytest.mark.slow)]
)
def test_copy_exports_to_every_format(tmp_path, format):
    """The traced formats (a trace and export's own check each: slow) run in make test-slow."""
    torch.manual_seed(0)
    values = dict(vocab_size=30, width=16, heads=2, layers=3, ffn_width=32, max_length=20, resample_every=1)
    config = ParticleConfig(**values, ess_threshold=0.95, resampling="copy")
    model = ParticleTransformer(config).eval()
    path = pf.export(model, tmp_path / FORMAT_FILES[format], format)
    loaded = pf.load(path)
    generator = torch.Generator().manual_seed(1)
    resampled = []
    for size, length in [(1, 1), (3, 6), (4, 13), (2, 20)]:
        tokens = torch.randint(0, 30, (size, length), generator=generator)
        lengths = torch.randint(1, length + 1, (size,), generator=generator)
        lengths[0] = length
        mask = torch.arange(length)[None, :] < lengths[:, None]
        with torch.no_grad():
            expected, trace = model(tokens, mask)
        resampled.append(trace["resampled"].any())
        assert (loaded(tokens, mask) - expected).abs().max().item() <= 1e-5
    assert any(resampled)
