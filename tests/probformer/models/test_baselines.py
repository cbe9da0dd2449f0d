"""Baselines (BERT-style, Universal Transformer, pre-/post-LN) and the shipped configs."""

from pathlib import Path

import pytest
import torch

import probformer as pf
from probformer.models.baselines import Transformer, TransformerConfig, equal_size, parameter_count
from probformer.training import run_config


def _config(**overrides):
    return TransformerConfig(**{**dict(vocab_size=50, width=16, heads=2, layers=3, ffn_width=32, max_length=12,
                                       dropout=0.0), **overrides})  # fmt: skip


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("universal", [False, True])
def test_padding_does_not_change_real_tokens(norm, universal):
    torch.manual_seed(0)
    model = Transformer(_config(norm=norm, universal=universal)).eval()
    tokens = torch.randint(3, 50, (1, 6))
    padded = torch.cat([tokens, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.arange(10)[None] < 6
    short, _ = model(tokens)
    long, _ = model(padded, mask)
    torch.testing.assert_close(long[:, :6], short, rtol=1e-5, atol=1e-5)


def test_universal_transformer_ties_one_block():
    tied = Transformer(_config(universal=True, layers=5))
    untied = Transformer(_config(layers=5))
    assert len(tied.blocks) == 1 and len(untied.blocks) == 5
    block = sum(p.numel() for p in untied.blocks[0].parameters())
    assert parameter_count(untied.config) - parameter_count(tied.config) == 4 * block - 5 * 16  # minus step signal
    _, hidden = tied(torch.randint(3, 50, (2, 7)))
    assert hidden.shape == (5, 2, 7, 16)


def test_post_ln_outputs_are_normalised():
    model = Transformer(_config(norm="post")).eval()
    _, hidden = model(torch.randint(3, 50, (2, 7)))
    torch.testing.assert_close(hidden[-1].mean(-1), torch.zeros(2, 7), atol=1e-5, rtol=0)


@pytest.mark.parametrize("universal", [False, True])
def test_equal_size_matches_a_probabilistic_transformer(universal):
    pt = pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=500, labels=32, channels=2, rank=8, iterations=3))
    target = sum(p.numel() for p in pt.parameters())
    config = equal_size(_config(vocab_size=500, max_length=64, universal=universal), target)
    assert abs(parameter_count(config) - target) / target < 0.05
    assert config.width % config.heads == 0


def test_bad_config():
    with pytest.raises(ValueError, match="norm"):
        _config(norm="sandwich")
    with pytest.raises(ValueError, match="divisible"):
        _config(width=15)
    with pytest.raises(ValueError, match="max_length"):
        Transformer(_config())(torch.randint(3, 50, (1, 13)))
    with pytest.raises(ValueError, match="token ids"):
        Transformer(_config())(torch.full((1, 3), 50))


CONFIGS = sorted(Path("configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    config = run_config.load(path)
    config.model_config(vocab_size=10_000, num_classes=17)


@pytest.mark.parametrize("size", ["small", "medium"])
def test_shipped_baselines_have_the_pt_parameter_count(size):
    """At PTB's vocabulary (10,000 ids), within 5%."""
    counts = {}
    for kind in ("pt", "bert", "ut"):
        config = run_config.load(Path("configs") / f"{kind}-{size}.toml")
        _, model_cls = __import__("probformer.models.registry", fromlist=["classes"]).classes(config.kind)
        with torch.device("meta"):
            model = model_cls(config.model_config(vocab_size=10_000))
        counts[kind] = sum(p.numel() for p in model.parameters())
    assert abs(counts["bert"] - counts["pt"]) / counts["pt"] < 0.05, counts
    assert abs(counts["ut"] - counts["pt"]) / counts["pt"] < 0.05, counts
