"""The Probabilistic Transformer with the shared ternary form (``ternary_form="shared"``):
μP (equal to the standard model at the base width, the documented groups and
initial stds away from it, training), and export in every format (the oracle: the
trainable model itself, in eval mode)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import probformer as pf
from probformer import mup

torch.set_num_threads(1)


VOCAB = 40


def config(**overrides):
    base = dict(vocab_size=VOCAB, labels=12, channels=2, rank=3, global_labels=3, gamma=1, iterations=2)
    return pf.PTConfig(**{**base, "ternary_form": "shared", "dropout": 0.0, **overrides})


def batch(seed=0, size=4, length=10):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (size, length), generator=generator)
    return tokens, torch.arange(length)[None] < torch.tensor([length, 7, 4, 1])[:size, None]


def test_mup_at_the_base_width_is_the_standard_model_and_groups_the_bias_as_input():
    torch.manual_seed(1)
    standard = pf.ProbabilisticTransformer(config())
    torch.manual_seed(1)
    scaled = pf.ProbabilisticTransformer(config(mup=True, mup_base_width=12))
    tokens, mask = batch()
    assert torch.equal(standard(tokens, mask)[0], scaled(tokens, mask)[0])
    roles = mup.roles(scaled)
    assert (roles["crf.shared_u"], roles["crf.shared_v"], roles["crf.shared_bias"]) == ("hidden", "hidden", "input")


def test_mup_widened_initialisation_follows_the_table():
    base = config(mup=True, mup_base_width=12)
    wide = mup.widen(base, 48)  # m = 4, channels x 4
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(wide)
    # hidden: the standard std at the base width (r^-1/2, r fixed) times m^-1/2
    std = model.crf.shared_u.std().item()
    assert std == pytest.approx(3**-0.5 * 4**-0.5, rel=0.1)
    assert torch.equal(model.crf.shared_bias, torch.zeros_like(model.crf.shared_bias))


def test_mup_shared_form_trains():
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(config(mup=True, mup_base_width=6, kernel="fused"))
    optimiser = torch.optim.AdamW(mup.param_groups(model, lr=3e-2))
    tokens, mask = batch()
    targets = tokens.masked_fill(~mask, -100)
    losses = []
    for _ in range(15):
        output, _ = model(tokens, mask)
        loss = F.cross_entropy(output.transpose(1, 2), targets)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert model.crf.shared_bias.abs().max() > 0  # the distance prior learns


# the traced formats take 20-30 s each on a shared CPU
FORMATS = ["torch", pytest.param("exported", marks=pytest.mark.slow), pytest.param("onnx", marks=pytest.mark.slow)]


@pytest.mark.parametrize("format", FORMATS)
def test_export_reproduces_the_model(tmp_path, format):
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(config(topology="full | root()")).eval()
    with torch.no_grad():
        model.crf.shared_bias.normal_()
    name = {"torch": "model", "exported": "model.pt2", "onnx": "model.onnx"}[format]
    artefact = pf.load(pf.export(model, tmp_path / name, format, max_length=20))
    for seed, length in [(0, 10), (1, 20), (2, 3)]:
        tokens, mask = batch(seed, size=3, length=length)
        with torch.no_grad():
            expected, found = model(tokens, mask)[0], artefact(tokens, mask)
        assert (found - expected).abs().max().item() <= 1e-5


def test_config_refuses_mup_with_other_tensor_forms():
    with pytest.raises(ValueError, match="needs ternary_form='low_rank' or 'shared'"):
        config(mup=True, ternary_form="cp")
    assert dataclasses.replace(config(), mup=True).ternary_form == "shared"


def test_shipped_shared_config_has_the_grouped_parameter_count():
    """configs/pt-small-shared.toml against pt-small.toml at PTB's vocabulary: within 5%."""
    from pathlib import Path

    from probformer.models import registry
    from probformer.training import run_config

    counts = {}
    for name in ("pt-small", "pt-small-shared"):
        run = run_config.load(Path("configs") / f"{name}.toml")
        _, model_class = registry.classes(run.kind)
        with torch.device("meta"):
            model = model_class(run.model_config(vocab_size=10_000))
        counts[name] = sum(p.numel() for p in model.parameters())
        assert model.crf.ternary_form == ("shared" if name.endswith("shared") else "low_rank")
    assert abs(counts["pt-small-shared"] - counts["pt-small"]) / counts["pt-small"] < 0.05, counts
