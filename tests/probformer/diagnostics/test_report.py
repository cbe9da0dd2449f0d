"""The diagnostics report (probformer.diagnostics.report): every variable and plot written, read
by ArviZ, every model kind, padding, numbers equal to a hand computation, and ``probformer
diagnose``."""

import math
import warnings

import numpy as np
import pytest
import torch

from probformer import diagnostics

# ---- report, plots, CLI ----------------------------------------------------------------


def sentence_mean(report, name):
    """A variable averaged over the sentences (chain and draw), NaN ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices stay NaN
        return np.nanmean(report["sample_stats"][name].values, axis=(0, 1))


@pytest.mark.parametrize("kind", ["pt", "particle"])
def test_report_has_every_variable_and_plots_are_written(kind, tmp_path):
    import probformer as pf

    torch.manual_seed(0)
    if kind == "pt":
        model = pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=30, labels=8, channels=2, rank=2, iterations=3))
    else:
        model = pf.ParticleTransformer(pf.ParticleConfig(vocab_size=30, width=16, heads=2, layers=3, ffn_width=32))
    tokens = torch.randint(0, 30, (3, 24))
    mask = torch.ones(3, 24, dtype=torch.bool)
    mask[2, 20:] = False
    report = diagnostics.report(model, tokens, mask)
    assert report.groups() == ["sample_stats", "constant_data"]
    stats = report["sample_stats"]
    depth, width = ("iteration", "channel") if kind == "pt" else ("layer", "head")
    assert (stats.attrs["depth_dim"], stats.attrs["width_dim"]) == (depth, width)
    assert stats["received_ess"].dims == ("chain", "draw", depth, width)
    assert stats["received_ess"].shape == stats["query_ess"].shape == (1, 3, 3, 2)
    assert stats["attention_received"].dims == ("chain", "draw", depth, width, "token")
    assert stats["cosine"].dims == ("chain", "draw", depth)
    assert stats["draw"].values.tolist() == [0, 1, 2] and stats[depth].values.tolist() == [0, 1, 2]
    assert report["constant_data"]["mask"].values.tolist() == mask.int().tolist()
    assert ("elbo" in stats) == (kind == "pt")
    assert ("smc_log_weights" in stats) == (kind == "particle")
    if kind == "particle":
        assert stats["smc_log_weights"].dims == ("chain", "draw", "layer", "particle")
        assert np.isnan(stats["smc_log_weights"].values[0, 2, :, 20:]).all()  # padding is no particle
    for name, array in stats.data_vars.items():  # every variable says what it is and in what units
        assert array.attrs["long_name"] and array.attrs["units"], name
    values = stats["received_ess"].values
    assert np.all((values > 0) & (values <= 1 + 1e-9))
    paths = diagnostics.plot_report(report, tmp_path)
    names = [path.split("/")[-1] for path in paths]
    figures = ["ess.png", "pareto_k.png", "diversity.png"] + (["elbo.png"] if kind == "pt" else [])
    assert names == [*figures, "report.md"]
    for name in names[:-1]:
        assert (tmp_path / name).stat().st_size > 1000
    page = (tmp_path / "report.md").read_text()
    assert all(f"]({name})" in page for name in names[:-1])  # every figure shown, with its paragraph
    assert page.count("\n## ") == len(names) - 1


def test_the_written_report_is_read_by_arviz(tmp_path, monkeypatch):
    """Acceptance: report.nc opens in ArviZ; az.summary, az.plot_khat and
    az.plot_ess run on it, with the report's own dim names."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import arviz as az
    import matplotlib.pyplot as plt

    model = build("particle")
    torch.manual_seed(1)
    tokens = torch.randint(0, 30, (6, 24))
    diagnostics.report(model, tokens).to_netcdf(str(tmp_path / "report.nc"))
    report = az.from_netcdf(str(tmp_path / "report.nc"))
    assert report["sample_stats"]["received_pareto_k"].dims == ("chain", "draw", "layer", "head")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one chain: ArviZ notes that r_hat needs two
        table = az.summary(report, group="sample_stats", var_names=["received_ess", "cosine", "smc_ess"])
    assert "received_ess[0, 1]" in table.index and "cosine[2]" in table.index
    mean = report["sample_stats"]["received_ess"].values[0, :, 0, 1].mean()  # layer 0, head 1: over sentences
    assert table.loc["received_ess[0, 1]", "mean"] == pytest.approx(mean, abs=1e-3)  # az.summary rounds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ArviZ prefers ELPDData; a DataArray is supported
        warnings.simplefilter("ignore", matplotlib.MatplotlibDeprecationWarning)  # inside ArviZ's backend
        axes = az.plot_khat(report["sample_stats"]["received_pareto_k"], threshold=0.7)
        assert len(axes.collections[0].get_offsets()) == 6 * 3 * 2  # a k-hat per sentence, layer and head
        plt.close("all")
        axes = az.plot_ess(report["sample_stats"], var_names=["cosine"], kind="local")
        assert np.size(axes) == 3  # one panel per layer
        plt.close("all")


def build(kind: str, vocab: int = 30):
    import probformer as pf
    from probformer.models.baselines import Transformer, TransformerConfig

    torch.manual_seed(0)
    small = dict(vocab_size=vocab, width=16, heads=2, ffn_width=32)
    return {
        "pt": lambda: pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=vocab, labels=8, channels=2, rank=2)),
        "particle": lambda: pf.ParticleTransformer(pf.ParticleConfig(layers=3, **small)),
        "transformer": lambda: Transformer(TransformerConfig(layers=2, **small)),
        "swarm": lambda: pf.SwarmFormer(pf.SwarmConfig(layers=3, clusters=4, **small)),
        "folded": lambda: pf.FoldedContext(pf.FoldedContextConfig(segment=4, **small)),
    }[kind]()


# what each kind's trace offers, hence its report's variables (report.py's table)
ATTENTION = {"query_ess", "received_ess", "received_pareto_k", "attention_received"}


DIVERSITY = {"cosine", "effective_rank", "rank_one_distance"}


OFFERED = {
    "pt": ATTENTION | {"elbo"},
    "particle": ATTENTION | {"smc_ess", "smc_pareto_k", "smc_log_weights"},
    "transformer": ATTENTION,
    "swarm": {"cluster_ess", "cluster_tokens"},
    "folded": set(),
}


CASES = {
    "length 1": (torch.tensor([[3], [7]]), None),
    "padded": (torch.arange(12).view(2, 6), torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0]], dtype=torch.bool)),
    "normal": (torch.arange(24).view(3, 8) % 30, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", list(OFFERED))
def test_report_works_on_every_kind_length_one_and_padding(kind, case, tmp_path):
    model = build(kind)
    tokens, mask = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to measure is NaN, silently and by design
        report = diagnostics.report(model, tokens, mask)
    stats = report["sample_stats"]
    assert set(stats.data_vars) == DIVERSITY | OFFERED[kind]
    depth = "iteration" if kind == "pt" else "layer"
    layers = stats.sizes[depth]
    assert layers == {"pt": 5, "particle": 3, "transformer": 2, "swarm": 3, "folded": 1}[kind]
    assert stats.sizes["draw"] == tokens.shape[0]
    for name, array in stats.data_vars.items():  # one name per axis in every variable
        assert array.dims[:3] == ("chain", "draw", "iteration" if name == "elbo" else depth), name
        assert not {"layer", "iteration"} <= set(array.dims) and not {"head", "channel"} <= set(array.dims)
    if case == "length 1":  # one token: it is all its sentence's diversity, and all its own attention
        assert sentence_mean(report, "effective_rank") == pytest.approx([1.0] * layers)
        assert sentence_mean(report, "cosine") == pytest.approx([1.0] * layers)
        if kind in ("particle", "transformer"):  # its only key is itself: ESS 1 of 1
            assert stats["query_ess"].values == pytest.approx(np.ones((1, 2, layers, 2)))
            assert stats["received_ess"].values == pytest.approx(np.ones((1, 2, layers, 2)))
        if kind == "pt":  # the full topology gives a lone token no head: nothing to measure
            assert np.isnan(stats["query_ess"].values).all() and np.isnan(stats["received_ess"].values).all()
    elif "received_ess" in stats:
        for name in ("query_ess", "received_ess"):
            values = stats[name].values
            assert np.all((values > 0) & (values <= 1 + 1e-9)), (name, values)
    paths = diagnostics.plot_report(report, tmp_path)
    assert {p.split("/")[-1] for p in paths} == {"diversity.png", "report.md"} | {
        "pt": {"ess.png", "pareto_k.png", "elbo.png"},
        "particle": {"ess.png", "pareto_k.png"},
        "transformer": {"ess.png", "pareto_k.png"},
        "swarm": {"routing.png"},
        "folded": set(),
    }[kind]
    table = diagnostics.describe(report).splitlines()
    assert table[0].split()[0] == depth and len(table) == layers + 1 + (kind == "pt")


@pytest.mark.parametrize("kind", ["pt", "transformer", "swarm", "folded"])
def test_padding_does_not_change_the_report(kind):
    """A sentence alone and the same sentence padded: the same numbers."""
    model = build(kind)
    sentence = torch.tensor([[4, 9, 2, 7, 1]])
    alone = diagnostics.report(model, sentence)["sample_stats"]
    padded = diagnostics.report(
        model, torch.cat([sentence, torch.zeros(1, 3, dtype=torch.long)], 1), torch.arange(8)[None] < 5
    )["sample_stats"]
    for name, array in alone.data_vars.items():
        cut = padded[name].isel(token=slice(0, 5)) if "token" in array.dims else padded[name]
        np.testing.assert_allclose(cut.values, array.values, rtol=1e-5, atol=1e-6)
        if "token" in array.dims:
            assert np.isnan(padded[name].isel(token=slice(5, None)).values).all()  # padding measures nothing


@pytest.mark.parametrize("universal", [False, True])
def test_transformer_trace_is_its_forward_with_attention(universal):
    """The hooks that materialise the attention change nothing and leave nothing behind."""
    from probformer.models.baselines import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=30, width=16, heads=2, layers=3, universal=universal)).eval()
    tokens, mask = torch.randint(0, 30, (2, 6)), torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    trace = model.diagnostic_trace(tokens, mask)
    torch.testing.assert_close(trace["hidden"], model(tokens, mask)[1], rtol=1e-5, atol=1e-5)
    attention = trace["attention"]
    assert attention.shape == (3, 2, 2, 6, 6)
    torch.testing.assert_close(attention.sum(-1), torch.ones(3, 2, 2, 6))
    assert (attention[:, 1, :, :, 3:] == 0).all()  # padded keys get nothing
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in model.blocks)


class HandMade(torch.nn.Module):
    """A trace written by hand, for oracle checks of the report's arithmetic."""

    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def diagnostic_trace(self, tokens, mask):
        return self.trace


def test_report_numbers_equal_a_hand_computation():
    # one layer, two heads, two sentences of lengths 3 and 2 (padded to 3)
    attention = torch.zeros(1, 2, 2, 3, 3, dtype=torch.float64)
    attention[0, 0, 0] = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.25, 0.75, 0.0]])
    attention[0, 0, 1] = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])
    attention[0, 1, 0] = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.3, 0.3, 0.4]])  # row 2: padding
    attention[0, 1, 1] = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # token 0: no head
    mask = torch.tensor([[True, True, True], [True, True, False]])
    log_weights = torch.tensor([[[0.0, 0.0, math.log(2.0)], [0.0, 1e30, 123.0]]], dtype=torch.float64)
    assignment = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    trace = {
        "hidden": torch.randn(1, 2, 3, 4, dtype=torch.float64),
        "attention": attention,
        "log_weights": log_weights,
        "elbo": torch.tensor([[-3.0, -5.0], [-2.0, -4.0]]),
        "routing": [{"assignment": assignment}],
    }
    report = diagnostics.report(HandMade(trace), torch.zeros(2, 3, dtype=torch.long), mask)
    stats = report["sample_stats"]

    def by_hand(weights):
        return sum(weights) ** 2 / sum(w * w for w in weights)

    lengths = [3, 2]
    for head in range(2):
        for b, n in enumerate(lengths):
            a = attention[0, b, head, :n, :n].tolist()
            measured = [by_hand(row) / n for row in a if sum(row) > 0]
            assert stats["query_ess"].values[0, b, 0, head] == pytest.approx(sum(measured) / len(measured), rel=1e-12)
            received = [sum(a[i][j] for i in range(n)) for j in range(n)]
            assert stats["received_ess"].values[0, b, 0, head] == pytest.approx(by_hand(received) / n, rel=1e-12)
            assert stats["attention_received"].values[0, b, 0, head, :n].tolist() == pytest.approx(received)
    assert np.isnan(stats["attention_received"].values[0, 1, 0, :, 2]).all()  # padding
    # SMC weights: sentence 0 is (1, 1, 2) -> ESS 16 / 6 of 3; sentence 1 keeps its real (1e30, 0): ESS 1 of 2
    assert stats["smc_ess"].values[0, :, 0].tolist() == pytest.approx([(16 / 6) / 3, 1 / 2], rel=1e-12)
    assert stats["elbo"].values[0].tolist() == [[-3.0, -2.0], [-5.0, -4.0]]  # [sentence, iteration]
    # clusters hold (2, 1) real tokens in sentence 0 and (2, 0) in sentence 1 (its third token is padding)
    assert stats["cluster_tokens"].values[0, :, 0].tolist() == [[2.0, 1.0], [2.0, 0.0]]
    assert stats["cluster_ess"].values[0, :, 0].tolist() == pytest.approx([by_hand([2, 1]) / 2, 1 / 2])
    means = diagnostics.layer_means(report)  # the table's numbers: means over sentences and heads
    assert means["cluster_ess"][0] == pytest.approx((by_hand([2, 1]) / 2 + 1 / 2) / 2)
    assert diagnostics.describe(report).splitlines()[-1] == "ELBO per iteration (nats per sentence): -4.00 -3.00"


def test_report_needs_the_protocol():
    with pytest.raises(TypeError, match="does not offer diagnostic_trace"):
        diagnostics.report(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))


def test_diagnose_cli_writes_the_report(tmp_path, capsys):
    import probformer as pf
    from probformer import cli
    from probformer.training import checkpoint, data

    sentences = data.ptb_sentences("valid")[:50]
    vocab = data.Vocabulary.build(sentences)
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=len(vocab), labels=8, channels=2, rank=2, iterations=2))
    checkpoint.save(model, tmp_path / "ck", vocab)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(s) for s in sentences[:5]) + "\n")
    assert cli.main(["diagnose", str(tmp_path / "ck"), "--data", str(text), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "ProbabilisticTransformer on 5 sentences" in out and "ELBO per iteration" in out
    assert (tmp_path / "out" / "report.nc").stat().st_size > 0
    assert cli.main(["diagnose", str(tmp_path / "ck"), "--data", "nowhere.txt", "--out", str(tmp_path / "o2")]) == 2
    assert "probformer diagnose: error: " in capsys.readouterr().err  # one line, no traceback


def test_diagnose_cuts_long_sentences_where_the_run_did(tmp_path, capsys):
    """The run's data.max_length (its run.json) is the window, as for evaluate: diagnose read
    only the model's max_length, which a PT has not, and ran whole sentences."""
    import json

    import probformer as pf
    from probformer import cli
    from probformer.training import checkpoint, data

    sentences = [[f"w{(i + k) % 9}" for i in range(10 + k)] for k in range(4)]  # 10 to 13 words
    vocab = data.Vocabulary.build(sentences)
    torch.manual_seed(0)
    model = pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=len(vocab), labels=4, channels=1, rank=2, iterations=1))
    checkpoint.save(model, tmp_path / "run" / "model", vocab)
    (tmp_path / "run" / "run.json").write_text(json.dumps({"data": {"max_length": 5, "mask_rate": 0.15}}))
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(s) for s in sentences) + "\n")
    assert (
        cli.main(["diagnose", str(tmp_path / "run" / "model"), "--data", str(text), "--out", str(tmp_path / "o")]) == 0
    )
    assert "4 longer than" in capsys.readouterr().out
    import arviz as az

    report = az.from_netcdf(tmp_path / "o" / "report.nc")
    assert report["sample_stats"].sizes["draw"] == sum(-(-len(s) // 5) for s in sentences)  # windows of 5


def test_a_particle_transformers_smc_ess_is_the_ess_that_decided_its_resampling():
    """The report read the log-weights after resampling had reset them to 0: every layer that
    resampled (the most degenerate) showed ESS/n = 1. Here each layer resamples, and the
    report's ESS is (sum w)^2 / sum w^2 / n of the weights before the reset, by hand."""
    import probformer as pf

    torch.manual_seed(0)
    config = pf.ParticleConfig(
        vocab_size=50,
        width=16,
        heads=2,
        layers=4,
        ffn_width=32,
        dropout=0.0,
        resampling="copy",
        ess_threshold=1.0,
        resample_every=1,
    )
    model = pf.ParticleTransformer(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.weight.mul_(4.0)  # peaked attention: degenerate weights
    tokens = torch.randint(0, 50, (3, 24))
    with torch.no_grad():
        _, trace = model(tokens)
    assert trace["resampled"].all()
    stats = diagnostics.report(model, tokens)["sample_stats"]
    w = (trace["log_weights"].double() - trace["log_weights"].double().amax(-1, keepdim=True)).exp()
    by_hand = (w.sum(-1) ** 2 / w.square().sum(-1) / 24).T  # [sentence, layer]
    assert stats["smc_ess"].values[0] == pytest.approx(by_hand.numpy(), rel=1e-6)
    assert (by_hand < 0.9).any()  # degenerate somewhere: a reset would have read 1


def test_a_degenerate_k_hat_counts_in_every_mean_over_sentences(tmp_path):
    """Sentence 0 is an attention sink (every query reads token 0: k-hat +inf, "degenerate");
    sentence 1 is diffuse. Their mean is +inf in the table, the plots and describe(): the
    means had dropped +inf like NaN and shown only the healthy sentence's k-hat."""
    from probformer.diagnostics import plots

    n = 30
    generator = torch.Generator().manual_seed(0)
    attention = torch.zeros(1, 2, 1, n, n, dtype=torch.float64)
    attention[0, 0, 0, :, 0] = 1.0
    attention[0, 1, 0] = torch.rand(n, n, generator=generator, dtype=torch.float64).softmax(-1)
    hidden = torch.randn(1, 2, n, 4, generator=generator, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = diagnostics.report(HandMade({"hidden": hidden, "attention": attention}), torch.zeros(2, n).long())
    k = report["sample_stats"]["received_pareto_k"].values[0, :, 0, 0]
    assert k[0] == math.inf and np.isfinite(k[1])
    assert diagnostics.layer_means(report)["received_pareto_k"].tolist() == [math.inf]
    assert plots._mean_over_sentences(report["sample_stats"]["received_pareto_k"], ["layer", "head"]).tolist() == [
        [math.inf]
    ]
    assert " inf " in diagnostics.describe(report)
    plots.plot_report(report, tmp_path)  # an infinite mean is drawn (clipped), not an error
