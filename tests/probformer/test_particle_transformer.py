import math

import pytest
import torch

import probformer as pf
from probformer.models.particle_transformer import ParticleConfig, ParticleTransformer


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
    for layer in range(6):
        if (layer + 1) % 2 == 0:
            expected = torch.ones(8, dtype=torch.bool) if threshold >= 1 else trace["ess"][layer] < threshold
            assert torch.equal(trace["resampled"][layer], expected)
            assert (trace["log_weights"][layer][trace["resampled"][layer]] == 0).all()
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


def test_compiled_model_equals_eager():
    torch.manual_seed(5)
    model = ParticleTransformer(small(ess_threshold=0.5)).eval()
    tokens = torch.randint(0, 40, (2, 10))
    compiled = torch.compile(lambda t: model(t)[0], fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens)[0], atol=1e-5, rtol=1e-5)


def test_exported_from_the_package():
    assert pf.ParticleTransformer is ParticleTransformer and math.isfinite(1.0)
