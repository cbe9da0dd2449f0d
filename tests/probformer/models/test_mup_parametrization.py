"""μP (probformer.models.mup_parametrization): equal to the standard model at the base width,
groups and multipliers as documented, initial stds, widening."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inference
import probformer as pf
from probformer import mup


def _config(**overrides):
    base = dict(vocab_size=40, labels=16, channels=2, rank=4, iterations=2, dropout=0.0, global_labels=4)
    return pf.PTConfig(**{**base, **overrides})


@pytest.mark.parametrize("paradigm", mup.PARADIGMS)
@pytest.mark.parametrize("topology", ["full", "window(2) | star()"])
def test_at_base_width_mup_equals_standard(paradigm, topology):
    standard = _config(topology=topology)
    scaled = dataclasses.replace(standard, mup=True, mup_base_width=16, mup_paradigm=paradigm)
    torch.manual_seed(3)
    a = pf.ProbabilisticTransformer(standard)
    torch.manual_seed(3)
    b = pf.ProbabilisticTransformer(scaled)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    assert a.mean_field.scales() == b.mean_field.scales()
    tokens = torch.randint(3, 40, (3, 9))
    mask = torch.arange(9) < torch.tensor([9, 5, 2])[:, None]
    assert torch.equal(a(tokens, mask)[0], b(tokens, mask)[0])
    groups_a = [(g["name"], g["lr"], g["weight_decay"]) for g in mup.param_groups(a, 1e-3, 0.1)]
    groups_b = [(g["name"], g["lr"], g["weight_decay"]) for g in mup.param_groups(b, 1e-3, 0.1)]
    assert groups_a == groups_b


@given(st.sampled_from(mup.PARADIGMS), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_param_groups_partition_and_multipliers(paradigm, factor, use_mup):
    config = mup.widen(_config(mup=use_mup, mup_paradigm=paradigm), 16 * factor)
    model = pf.ProbabilisticTransformer(config)
    groups = mup.param_groups(model, lr=0.5, weight_decay=0.1)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each exactly once
    m = factor if use_mup else 1
    expected = {
        "input": (0.5, 0.1, {"crf.unary"}),
        "input/no_decay": (0.5, 0.0, {"head.decoder.bias"}),
        "hidden": (0.5 / m, 0.1, {"crf.ternary_u", "crf.ternary_v", "crf.binary"}),
        "output": (0.5 / m, 0.1, {"head.decoder.weight"}),
    }
    assert {g["name"]: (g["lr"], g["weight_decay"], set(g["param_names"])) for g in groups} == expected
    torch.optim.AdamW(groups)  # the groups are valid AdamW groups


@pytest.mark.parametrize("paradigm", mup.PARADIGMS)
def test_initial_stds_follow_the_table(paradigm):
    """Relative to the base width: input std constant, hidden std * m^-1/2, output * m^-1."""
    torch.manual_seed(0)
    base = _config(mup=True, labels=32, channels=4, rank=16, vocab_size=4000, global_labels=64, mup_paradigm=paradigm)
    wide = mup.widen(base, 256)
    stds = {}
    for config in (base, wide):
        torch.manual_seed(0)
        model = pf.ProbabilisticTransformer(config)
        stds[config.labels] = {name: p.std().item() for name, p in model.named_parameters()}
    m = 8
    ratio = {name: stds[256][name] / stds[32][name] for name in stds[32]}
    assert ratio["crf.unary"] == pytest.approx(1, rel=0.05)
    assert ratio["crf.ternary_u"] == pytest.approx(m**-0.5, rel=0.05)
    assert ratio["crf.binary"] == pytest.approx(m**-0.5, rel=0.05)
    assert ratio["head.decoder.weight"] == pytest.approx(1 / m, rel=0.05)


def test_engine_scales_are_relative_to_the_base():
    config = mup.widen(_config(mup=True, mup_paradigm="channels"), 64)  # m = 4, r fixed
    scales = mup.engine_scales(config)
    assert scales.temperature == pytest.approx(4) and scales.attention == pytest.approx(16)
    assert scales.ternary_message == pytest.approx(4) and scales.topic_logits == pytest.approx(16)
    config = mup.widen(_config(mup=True, mup_paradigm="rank"), 64)  # m = 4, r grows
    scales = mup.engine_scales(config)
    assert scales.temperature == pytest.approx(1) and scales.attention == pytest.approx(4)
    model = pf.ProbabilisticTransformer(config)
    # the information weights stay those of the base width (attention = d0 = 16 under "reference")
    assert model.mean_field.scales()["attention"] == pytest.approx(16 * 4)


@given(st.integers(1, 6), st.integers(1, 5), st.sampled_from(mup.PARADIGMS))
@settings(max_examples=30)
def test_the_global_factors_grow_with_the_width_multiplier_even_below_one_base_global_label(g, k, paradigm):
    """global_labels grow with d: the global messages' factor relative to the
    base is the width multiplier m, also where the base's global count g / m is below 1; it had
    been read as 1 there, so the factor was g instead of m."""
    m = 2**k
    config = _config(mup=True, mup_paradigm=paradigm, labels=4 * m, channels=2 * m, rank=4 * m,
                     global_labels=g, mup_base_width=4)  # fmt: skip
    scales = mup.engine_scales(config)
    tau = scales.temperature  # d / r relative to the base's: 1 or m by paradigm
    assert scales.topic_message == pytest.approx(m) and scales.topic_logits == pytest.approx(tau * m)
    assert mup.engine_scales(_config(mup=True, labels=4 * m, mup_base_width=4, global_labels=0)).topic_message == 1


def test_widen_keeps_bookkeeping_and_survives_checkpoints(tmp_path):
    from probformer.training import checkpoint

    config = mup.widen(_config(mup=True, mup_paradigm="rank"), 64)
    assert (config.labels, config.channels, config.rank, config.global_labels) == (64, 2, 16, 16)
    assert config.mup_base_width == 16 and mup.widen(config, 32).mup_base_width == 16
    model = pf.ProbabilisticTransformer(config)
    checkpoint.save(model, tmp_path / "ckpt")
    loaded, _ = checkpoint.load(tmp_path / "ckpt")
    assert loaded.config == config
    assert loaded.mean_field.scales() == model.mean_field.scales()


def test_param_groups_through_wrappers():
    model = pf.ProbabilisticTransformer(mup.widen(_config(mup=True), 32))

    class Wrapper(torch.nn.Module):  # the attribute DDP and FSDP expose
        def __init__(self, module):
            super().__init__()
            self.module = module

    plain = [(g["name"], g["lr"]) for g in mup.param_groups(model, 1e-3)]
    assert [(g["name"], g["lr"]) for g in mup.param_groups(Wrapper(model), 1e-3)] == plain


def test_bad_input():
    with pytest.raises(ValueError, match="mup_paradigm"):
        _config(mup_paradigm="depth")
    with pytest.raises(ValueError, match="mup_base_width"):
        _config(mup_base_width=-1)
    with pytest.raises(ValueError, match="not a positive integer"):
        mup.widen(_config(channels=3), 24)
    with pytest.raises(ValueError, match="labels"):
        mup.widen(_config(), 0)
    with pytest.raises(ValueError, match="lr"):
        mup.param_groups(pf.ProbabilisticTransformer(_config()), lr=0.0)
    with pytest.raises(ValueError, match="unknown message weights"):
        _config(weights={"attention": 2.0, "nonsense": 1.0})


def test_base_shape_paradigms():
    config = mup.widen(_config(mup=True, mup_paradigm="channels"), 64)
    assert mup.base_shape(config) == {"labels": 16, "channels": 2, "rank": 4, "global_labels": 4}
    assert math.isclose(mup.width_multiplier(config), 4)


def test_information_weights_from_a_dict():
    config = _config(weights={"attention": 3.0, "unary": 0.5})
    model = pf.ProbabilisticTransformer(config)
    assert model.mean_field.weights == inference.MessageWeights(attention=3.0, unary=0.5)


@pytest.mark.parametrize("form", ["low_rank", "shared"])
@pytest.mark.parametrize("mup", [False, True])
def test_no_bias_is_decayed_and_every_other_matrix_is(form, mup):
    """The shared form's head bias is [K, C]: it went to the decayed weights, by its shape."""
    from probformer.models.mup_parametrization import param_groups

    model = pf.ProbabilisticTransformer(
        pf.PTConfig(vocab_size=20, labels=8, channels=2, rank=4, ternary_form=form, mup=mup)
    )
    decay = {n: g["weight_decay"] for g in param_groups(model, lr=1e-3, weight_decay=0.1) for n in g["param_names"]}
    for name, parameter in model.named_parameters():
        bias_or_vector = name.endswith("bias") or parameter.ndim < 2
        assert decay[name] == (0.0 if bias_or_vector else 0.1), name
    assert form != "shared" or decay["crf.shared_bias"] == 0.0
