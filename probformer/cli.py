"""The ``probformer`` command line."""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probformer", description="Transformers from inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="oracles on a real sentence, then PT vs an equal-size BERT on PTB")
    demo.add_argument("--steps", type=int, default=0, help="shorten both training runs to N steps (0: the configs)")
    demo.add_argument("--out", default="runs/demo", help="where the runs go (default runs/demo)")
    diagnose = commands.add_parser("diagnose", help="per-layer ESS, Pareto k-hat, diversity and ELBO of a checkpoint")
    diagnose.add_argument("checkpoint", help="a checkpoint directory (config.json, model.safetensors, vocabulary.json)")
    diagnose.add_argument(
        "--data", required=True, help="a text file (one sentence per line) or ptb-train|ptb-valid|ptb-test"
    )
    diagnose.add_argument("--out", required=True, help="directory for report.nc and the PNG figures")
    diagnose.add_argument("--sentences", type=int, default=16, help="how many sentences to diagnose (default 16)")
    train = commands.add_parser("train", help="train a model from a TOML config (see configs/)")
    train.add_argument("--config", required=True, help="a TOML run config, e.g. configs/pt-small.toml")
    train.add_argument("--out", help="run folder (default runs/<config name>)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    evaluate = commands.add_parser("evaluate", help="metric table of a checkpoint or run folder")
    evaluate.add_argument("checkpoint", help="a checkpoint folder or a training-run folder")
    evaluate.add_argument("--task", required=True, choices=["mlm", "pos", "uas"])
    evaluate.add_argument("--data", help="ptb, ewt or a text file (default: ptb for mlm, ewt otherwise)")
    evaluate.add_argument("--split", default="valid", choices=["valid", "test"])
    evaluate.add_argument("--sentences", type=int, default=0, help="evaluate the first N sentences (0: all)")
    export = commands.add_parser("export", help="write a checkpoint for deployment (torch, torch.export or ONNX)")
    export.add_argument("checkpoint", help="a checkpoint folder or a training-run folder")
    export.add_argument("--format", default="torch", choices=["torch", "exported", "onnx"])
    export.add_argument("--out", required=True, help="a folder (torch), a .pt2 file (exported) or a .onnx file")
    args = parser.parse_args(argv)
    if args.command == "train":
        return run_train(args.config, args.out, args.resume)
    try:
        return _run(args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as error:
        # a user error is one line on stderr, not a traceback
        print(f"probformer {args.command}: error: {error}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "export":
        from probformer import deploy

        path = deploy.export(args.checkpoint, args.out, format=args.format)
        print(f"wrote {path} ({args.format}); its logits match the checkpoint's within {deploy.TOLERANCE:g}")
        return 0
    if args.command == "evaluate":
        from probformer.training import evaluate as evaluation

        metrics = evaluation.evaluate(args.checkpoint, args.task, args.data, args.split, args.sentences)
        print(f"{args.task} on {args.data or ('ptb' if args.task == 'mlm' else 'ewt')} ({args.split}):")
        evaluation.print_table(args.task, metrics)
        return 0
    if args.command == "demo":
        from probformer import demo as demo_module

        return demo_module.main(args.steps, args.out)
    if args.command == "diagnose":
        return run_diagnose(args.checkpoint, args.data, args.out, args.sentences)
    return 2


def run_train(config_path: str, out: str | None, resume: bool) -> int:
    """``probformer train``: the whole config is validated (tables, keys, ranges, the
    model config and its size) before any folder is created; a bad config, bad data, a
    failed write or a non-finite loss ends with one line on stderr, not a traceback."""
    import sys
    from pathlib import Path

    from probformer.training import run_config
    from probformer.training.checkpoint import WriteError
    from probformer.training.trainer import train as run_training

    try:
        config = run_config.load(config_path)
        run_training(config, out or str(Path("runs") / Path(config_path).stem), resume=resume)
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError, WriteError) as error:
        print(f"probformer train: error: {error}", file=sys.stderr)
        return 1
    return 0


def read_sentences(data: str) -> list[list[str]]:
    """Sentences from ``ptb-<split>`` or a text file with one sentence per line."""
    from pathlib import Path

    from probformer.training.data import ptb_sentences

    if data.startswith("ptb-"):
        return ptb_sentences(data[4:])
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data {data!r} is neither ptb-<split> nor an existing file")
    sentences = [line.split() for line in path.read_text().splitlines() if line.strip()]
    if not sentences:
        raise ValueError(f"--data {data!r} holds no sentences")
    return sentences


def run_diagnose(checkpoint: str, data: str, out: str, count: int) -> int:
    from pathlib import Path

    from probformer import diagnostics
    from probformer.training import checkpoint as checkpoints
    from probformer.training import data as text

    if count < 1:
        raise ValueError(f"--sentences must be >= 1, got {count}")
    model, vocabulary = checkpoints.load(checkpoint)
    if vocabulary is None:
        raise ValueError(f"{checkpoint} has no vocabulary.json: cannot turn --data text into token ids")
    limit = getattr(model.config, "max_length", 512)
    sentences = [s for s in read_sentences(data) if 0 < len(s) <= limit][:count]
    if not sentences:
        raise ValueError(f"no sentence of --data fits the model's max_length={limit}")
    tokens, mask = next(text.batches(sentences, vocabulary, batch_size=len(sentences), max_length=limit))
    report = diagnostics.report(model, tokens, mask)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.to_netcdf(str(out_dir / "report.nc"))
    figures = diagnostics.plot_report(report, out_dir)
    print(f"{type(model).__name__} on {len(sentences)} sentences of {data}")
    div = report["diversity"]
    has_weights = "ess" in report.groups()  # models without attention weights report diversity only
    print("layer  " + ("ESS(received)/n  k-hat(mass)  " if has_weights else "") + "cosine  eff.rank  dist(rank-1)")
    for layer in range(div.sizes["layer"]):
        weights = ""
        if has_weights:
            ess = float(report["ess"]["columns"][layer].mean())
            k_hat = float(np.nanmean(report["pareto_k"]["attention_mass"][layer]))
            weights = f"{ess:15.3f}  {k_hat:11.3f}  "
        print(
            f"{layer:5d}  {weights}{float(div['cosine'][layer]):6.3f}  {float(div['effective_rank'][layer]):8.2f}"
            f"  {float(div['rank_one_distance'][layer]):12.3f}"
        )
    if "elbo" in report.groups():
        print("ELBO per iteration: " + " ".join(f"{v:.2f}" for v in report["elbo"]["elbo"].values))
    print(f"wrote {out_dir / 'report.nc'} and {', '.join(Path(f).name for f in figures)}")
    return 0
