"""``make demo``: the oracles agree on a real sentence; then a small Probabilistic
Transformer and a BERT-style baseline of equal parameter count learn masked-word
prediction on a PTB subset (configs/demo-*.toml), their validation perplexities are
compared, and the PT's diagnostics report is written."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import graphs
import inference
from probformer.training import data, run_config
from probformer.training.corpus import collate
from probformer.training.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def oracles_on_a_sentence(sentence: list[str]) -> None:
    torch.manual_seed(0)
    vocab = data.Vocabulary.build([sentence])
    tokens = torch.tensor([vocab.encode(sentence)])
    crf = graphs.CRF(vocab_size=len(vocab), labels=3, channels=1, rank=2, topology="window(2)").double()
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(1.5)
        exact = inference.Exact(crf).marginals(tokens)
        mean_field = inference.MeanField(crf, iterations=30, schedule="sequential")(tokens)
    gibbs = inference.Gibbs(crf, num_samples=2000, num_warmup=300).sample(tokens)
    print(f"sentence: {' '.join(sentence)!r}  (CRF: d=3 labels, window(2) heads)")
    print(f"  exact log Z               {exact.log_partition.item():9.4f}   (Pyro enumeration)")
    print(
        f"  mean-field ELBO           {mean_field.elbo.item():9.4f}   (<= log Z; KL = "
        f"{(exact.log_partition - mean_field.elbo).item():.4f})"
    )
    error = (gibbs.marginals.z - exact.z.detach()).abs().max().item()
    print(f"  Gibbs |q(Z) - exact| max  {error:9.4f}   (NumPyro, R-hat {gibbs.rhat:.3f})")


def diagnose(run: Path, config: run_config.RunConfig) -> list[str]:
    from probformer import diagnostics
    from probformer.training.corpus import prepare_corpus
    from probformer.training.evaluate import load_any

    model, vocabulary = load_any(run)
    model.eval()
    corpus = prepare_corpus(config.data, vocabulary)
    tokens, mask, _ = collate(corpus.valid[:16])
    with torch.no_grad():
        report = diagnostics.report(model, tokens, mask)
    folder = run / "diagnostics"
    folder.mkdir(exist_ok=True)
    report.to_netcdf(str(folder / "report.nc"))
    return [str(folder / "report.nc")] + diagnostics.plot_report(report, folder)


def export(run: Path) -> dict[str, Path]:
    """The trained PT for deployment: a torch-only folder and an ONNX file, each checked
    against the model on a padded batch by ``probformer.export``."""
    from probformer import deploy

    folder = run / "export"
    return {
        "torch": deploy.export(run, folder / "torch"),
        "onnx": deploy.export(run, folder / "model.onnx", format="onnx"),
    }


def configs(steps: int = 0) -> dict[str, run_config.RunConfig]:
    """Both runs' validated configs (``steps`` > 0 shortens them): checked before any work."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"--steps must be an integer >= 0 (0: the configs' own), got {steps!r}")
    loaded = {}
    for name in ("demo-pt", "demo-bert"):
        config = run_config.load(CONFIGS / f"{name}.toml")
        if steps:
            config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps, eval_every=0))
        loaded[name] = config
    return loaded


def main(steps: int = 0, out: str = "runs/demo") -> int:
    """``steps`` > 0 shortens both training runs (a smoke test)."""
    runs = configs(steps)  # every config checked before the oracles run
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    oracles_on_a_sentence(data.ptb_sentences("valid")[7][:6])
    results = {}
    for name, config in runs.items():
        run = Path(out) / name
        if run.exists():
            import shutil

            shutil.rmtree(run)
        print(f"\n== {name} ==", flush=True)
        results[name] = (train(config, run), run)
    print("\nvalidation masked-token perplexity (500 PTB validation sentences):")
    for name, (summary, _) in results.items():
        print(
            f"  {name:10s} {summary['valid']['perplexity']:8.1f}   {summary['parameters'] / 1e6:.2f}M parameters, "
            f"{summary['tokens_per_second']:.0f} tokens/s, {summary['seconds']:.0f} s"
        )
    pt_run = results["demo-pt"][1]
    files = diagnose(pt_run, run_config.load(CONFIGS / "demo-pt.toml"))
    exports = export(pt_run)
    print("\nwhere everything is:")
    for name, (_, run) in results.items():
        print(f"  {name}: model {run / 'model'}, metrics {run / 'metrics.jsonl'}, loss curve {run / 'loss.png'}")
    print(f"  PT diagnostics (ESS, Pareto k, diversity, ELBO per layer): {', '.join(files)}")
    print(
        f"  PT exported (logits match within 1e-5; docs/export.md): {exports['torch']} "
        f"(torch + safetensors only), {exports['onnx']} (onnxruntime)"
    )
    command = cli_command()
    print("\nnext (each runs as printed, from this folder):")
    print(f"  {command} evaluate {pt_run} --task mlm")
    print(f"  {command} diagnose {pt_run} --out {pt_run / 'diagnosis'}")
    print(f"  {command} export {pt_run} --format onnx --out {pt_run / 'export' / 'model.onnx'}")
    print(f"  in Python: model = probformer.from_pretrained({str(pt_run / 'model')!r})")
    return 0


def cli_command() -> str:
    """How to call the ``probformer`` command from the current folder: the script beside
    this interpreter (``.venv/bin/probformer`` after ``make demo``), so the printed
    commands run without activating the virtualenv; plain ``probformer`` when that
    script is not there."""
    import os
    import sys

    script = Path(sys.executable).parent / "probformer"
    if not script.is_file():
        return "probformer"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)
