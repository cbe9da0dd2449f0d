"""The ``probformer`` command line (docs/cli.md).

argparse, not click or typer: it is in the standard library, the verbs are few and flat,
and the one-line error convention needs one overridden method. Conventions:

- a user error (arguments, a config key or value, a missing or unreadable file, unusable
  data) is one line ``probformer VERB: error: ...`` on stderr and exit status 2;
- a run that fails on its own (a non-finite loss, a file that cannot be written) is one
  line too, with exit status 1; Ctrl-C is one line and exit status 130;
- ``--debug`` (before or after the verb) shows the traceback instead, and every warning;
- no warning reaches the terminal otherwise: the few that third-party code raises on
  correct use are silenced where they are raised, narrowly (deploy.exporter,
  diagnostics.trace_measures, inference.arviz_interop), not here.

Verbs import their heavy modules (torch, pyro, ...) when they run, so ``--help``,
``--version`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from probformer.mup import commands as mup_commands
from probformer.mup.commands import HelpFormatter  # the mup verbs' formatter, shared

__all__ = ["main", "build_parser", "version"]


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("probformer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line, ``PROG: error: MESSAGE``, exit status 2 (argparse
    prints the usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _verb(commands, name: str, help: str, description: str | None = None, **options) -> _Parser:
    return commands.add_parser(
        name, help=help, description=description or help, formatter_class=HelpFormatter, **options
    )


def _debug_option(parser) -> None:
    # accepted after the verb too; SUPPRESS leaves the top-level value alone when absent
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _data_options(parser, sentences: int, what: str, default_data: str) -> None:
    """The ``--data`` / ``--split`` / ``--sentences`` options of evaluate and diagnose."""
    parser.add_argument(
        "--data",
        help="ptb, ewt (probformer data fetch ud-ewt, or $PROBFORMER_EWT), hf:DIR or hf:BUILDER:FILES (a Hugging Face "
        "dataset, docs/training.md), or a text file / folder of *.txt, one sentence per line "
        f"(default: {default_data})",
    )
    parser.add_argument(
        "--split",
        choices=["train", "valid", "test", "all"],
        help="ptb, ewt and hf: their own splits (ewt's valid is its dev file); a text file or folder: valid is its "
        "last 5%% of lines (the trainer's held-out slice), train the rest, all every line, no test "
        "(default: valid for ptb/ewt/hf, all for a text file or folder)",
    )
    parser.add_argument("--sentences", type=int, default=sentences, help=what)


MODEL_HELP = (
    "a model folder: a training run's (its model/, else its latest checkpoint), a run's model/, a checkpoint "
    "or a torch export"
)


def build_parser() -> _Parser:
    parser = _Parser(
        prog="probformer",
        description="Transformers from inference: train, evaluate, diagnose and export models (docs/cli.md).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"probformer {version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and warnings (also after the verb)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    verbs = [
        _demo_verb(commands),
        _train_verb(commands),
        _evaluate_verb(commands),
        _diagnose_verb(commands),
        _export_verb(commands),
        *_mup_verbs(commands),
        *_data_verbs(commands),
    ]
    for verb in verbs:
        _debug_option(verb)
    return parser


def _demo_verb(commands) -> argparse.ArgumentParser:
    demo = _verb(commands, "demo", "oracles on a real sentence, then PT vs an equal-size BERT on PTB")
    demo.add_argument("--steps", type=int, default=0, help="shorten both training runs to N steps (0: the configs)")
    demo.add_argument("--out", default="runs/demo", help="where the runs go")
    return demo


def _train_verb(commands) -> argparse.ArgumentParser:
    train = _verb(
        commands,
        "train",
        "train a model from a TOML run config (see configs/)",
        "Train a model from a TOML run config. The whole config (file and --set) is validated before the run "
        "folder is created.",
    )
    train.add_argument("--config", required=True, help="a TOML run config, e.g. configs/pt-small.toml")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override one config value, as if written in the file (repeatable): model.rank=32, train.lr=3e-4, "
        'model.topology="full | root()"; VALUE is a TOML value, a bare word a string (default: none)',
    )
    train.add_argument("--out", help="run folder (default: runs/<config file name>)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    train.add_argument(
        "--print-config", action="store_true", help="print the validated config (file + --set) as JSON and stop"
    )
    return train


def _evaluate_verb(commands) -> argparse.ArgumentParser:
    evaluate = _verb(commands, "evaluate", "metric table of a model (a run, checkpoint or torch-export folder)")
    evaluate.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    evaluate.add_argument("--task", required=True, choices=["mlm", "lm", "pos", "uas"], help="the metric")
    _data_options(evaluate, 0, "evaluate the first N sentences of the split (0: all)", "ptb, or ewt for pos/uas")
    return evaluate


def _diagnose_verb(commands) -> argparse.ArgumentParser:
    diagnose = _verb(
        commands, "diagnose", "per-layer ESS, Pareto k-hat, diversity and ELBO of a model (any model folder)"
    )
    diagnose.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    _data_options(diagnose, 16, "diagnose the first N sentences of the split", "ptb")
    diagnose.add_argument("--out", required=True, help="folder for report.nc and the PNG figures")
    diagnose.add_argument(
        "--inference-gap",
        action="store_true",
        help="PT only: add log Z by tempered SMC, the KL gap and PSIS k-hat per sentence (docs/diagnostics.md)",
    )
    return diagnose


def _export_verb(commands) -> argparse.ArgumentParser:
    export = _verb(commands, "export", "write a model for deployment (torch folder, torch.export .pt2 or ONNX)")
    export.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    export.add_argument("--format", default="torch", choices=["torch", "exported", "onnx"], help="the artefact")
    export.add_argument(
        "--out", required=True, help="a folder (torch), a .pt2 file (exported) or a .onnx file (onnx), as --format"
    )
    return export


def _mup_verbs(commands) -> list[argparse.ArgumentParser]:
    mup = _verb(commands, "mup", "μP tools: coordinate check and neighbourhood search (docs/mup.md)")
    mup_verbs = mup.add_subparsers(dest="mup_command", required=True, metavar="MUP_VERB")
    mup_commands.add_commands(mup_verbs, formatter_class=HelpFormatter)
    return [mup, *mup_verbs.choices.values()]


def _data_verbs(commands) -> list[argparse.ArgumentParser]:
    data = _verb(commands, "data", "data sets: fetch one into the local cache")
    data_verbs = data.add_subparsers(dest="data_command", required=True, metavar="DATA_VERB")
    fetch = _verb(data_verbs, "fetch", "download a pinned data set release, checksum-checked, into the cache")
    fetch.add_argument("name", metavar="NAME", help="the data set, e.g. ud-ewt")
    fetch.add_argument("--cache", help="cache folder (default: $PROBFORMER_DATA, else the user cache folder)")
    return [data, fetch]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verb = [args.command, getattr(args, "mup_command", None) or getattr(args, "data_command", None)]
    prog = " ".join(["probformer", *filter(None, verb)])
    if args.debug:
        warnings.simplefilter("default")  # every warning once per place, DeprecationWarnings included
        return VERBS[args.command](args)
    try:
        return VERBS[args.command](args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, ImportError, FloatingPointError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1 if _run_failed(error) else 2


def _run_failed(error: BaseException) -> bool:
    """A failure of the run itself, not of what the user gave: a non-finite loss, or a
    checkpoint / run file that could not be written (disk full, permission)."""
    checkpoint = sys.modules.get("probformer.training.checkpoint")  # not imported: not raised
    written = checkpoint is not None and isinstance(error, checkpoint.WriteError)
    return written or isinstance(error, FloatingPointError)


def _existing(path: str, what: str = "a checkpoint, a model folder nor a training-run folder") -> str:
    """Fail before the heavy imports when a MODEL path does not exist."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is neither {what}: it does not exist")
    return path


# ---- the verbs ---------------------------------------------------------------------------------


def run_demo(args) -> int:
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0 (0: the configs' own), got {args.steps}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; the demo writes its runs into a folder")
    from probformer import demo

    return demo.main(args.steps, args.out)


def run_train(args) -> int:
    """The whole config is validated (tables, keys, ranges, the model config and its size)
    before any folder is created."""
    import json

    if not Path(args.config).is_file():
        raise FileNotFoundError(f"config file {args.config} does not exist")
    from probformer.training import run_config

    config = run_config.load(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=1))
        return 0
    from probformer.training.trainer import train

    train(config, args.out or str(Path("runs") / Path(args.config).stem), resume=args.resume)
    return 0


def run_evaluate(args) -> int:
    _check_count(args.sentences, 0)
    source, split = _old_data_spelling(args.data, args.split)  # --data ptb-test: ptb, test (as diagnose)
    _check_source(source, split)
    _existing(args.model)
    from probformer.training import evaluate as evaluation

    metrics = evaluation.evaluate(args.model, args.task, source, split, args.sentences)
    data = source or ("ewt" if args.task in ("pos", "uas") else "ptb")
    split = split or ("valid" if data in ("ptb", "ewt") or data.startswith("hf:") else "all")
    print(f"{args.task} on {data} ({split}):")
    evaluation.print_table(args.task, metrics)
    return 0


# the file suffix each export format writes (the torch format writes a folder)
EXPORT_SUFFIXES = {"exported": ".pt2", "onnx": ".onnx"}


def _check_export_path(out: str, format: str) -> None:
    """``--out`` must be what ``--format`` writes, checked before anything is traced."""
    suffix = Path(out).suffix.lower()
    wanted = EXPORT_SUFFIXES.get(format)
    if wanted is None and suffix in EXPORT_SUFFIXES.values():
        other = next(f for f, s in EXPORT_SUFFIXES.items() if s == suffix)
        raise ValueError(f"--out {out} names a {suffix} file, but --format torch writes a folder (--format {other}?)")
    if wanted is not None and suffix != wanted:
        raise ValueError(f"--out {out} does not end in {wanted}, the file --format {format} writes")


def run_export(args) -> int:
    _check_export_path(args.out, args.format)
    _existing(args.model)
    from probformer import deploy

    path = deploy.export(args.model, args.out, format=args.format)
    print(f"wrote {path} ({args.format}); its logits match the checkpoint's within {deploy.TOLERANCE:g}")
    return 0


def run_fetch(args) -> int:
    from probformer.training.fetch import fetch

    folder = fetch(args.name, cache=args.cache)
    print(f"{args.name}: {folder}")
    return 0


def _check_count(value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"--sentences must be >= {low}, got {value}")


def _old_data_spelling(data: str | None, split: str | None) -> tuple[str | None, str | None]:
    """``--data ptb-valid`` (the earlier spelling) is ``--data ptb --split valid``."""
    for source in ("ptb", "ewt"):
        for name in ("train", "valid", "test"):
            if data == f"{source}-{name}" and not Path(data).exists():
                if split not in (None, name):
                    raise ValueError(f"--data {data} and --split {split} disagree")
                return source, name
    return data, split


def _check_source(source: str | None, split: str | None) -> None:
    """``--data`` names a corpus, a Hugging Face dataset or an existing file or folder."""
    if source is not None and source not in ("ptb", "ewt") and not source.startswith("hf:"):
        if not Path(source).exists():
            raise FileNotFoundError(f"--data {source!r} is neither ptb, ewt nor an existing file or folder")


def run_diagnose(args) -> int:
    _check_count(args.sentences, 1)
    source, split = _old_data_spelling(args.data or "ptb", args.split)
    _check_source(source, split)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; diagnose writes report.nc and figures into a folder")
    _existing(args.model)
    from probformer import diagnostics
    from probformer.training import evaluate as evaluation
    from probformer.training.corpus import collate

    model, vocabulary = evaluation.load_any(args.model)
    if vocabulary is None:
        raise ValueError(f"{args.model} has no vocabulary.json: cannot turn --data text into token ids")
    sentences, split = evaluation.read_split(source, split)
    # the run's windows (its data.max_length), as evaluate cuts, else the model's (the PT has none)
    limit = evaluation.trained_max_length(args.model) or getattr(model.config, "max_length", None) or 10**9
    examples, windowed = evaluation.encode_windows(sentences[: args.sentences], vocabulary, limit)
    if not examples:
        raise ValueError(f"--data {source} --split {split} holds no sentences")
    tokens, mask, _ = collate(examples)
    report = diagnostics.report(model, tokens, mask)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.inference_gap:  # the mean field against the CRF's posterior (probformer.diagnostics.inference_gap)
        from probformer.diagnostics.inference_gap import add_to_report, plot_inference_gap

        gap = diagnostics.inference_gap(model, tokens, mask)
        report = add_to_report(report, gap)
        print(gap.table())
        print(f"wrote {plot_inference_gap(gap, out_dir)}")
    report.to_netcdf(str(out_dir / "report.nc"))
    figures = diagnostics.plot_report(report, out_dir)
    cut = f"; {windowed} longer than max_length={limit} cut into windows" if windowed else ""
    print(f"{type(model).__name__} on {min(args.sentences, len(sentences))} sentences of {source} ({split}){cut}")
    print(diagnostics.describe(report))
    print(f"wrote {out_dir / 'report.nc'} and {', '.join(Path(f).name for f in figures)}")
    return 0


VERBS = {
    "demo": run_demo,
    "train": run_train,
    "evaluate": run_evaluate,
    "diagnose": run_diagnose,
    "export": run_export,
    "mup": mup_commands.run,
    "data": run_fetch,
}
