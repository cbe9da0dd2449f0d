"""The μP tools as command-line verbs: ``probformer mup coord-check | neighbourhood``
(also ``python -m probformer.mup ...``). Both programs build their parsers here, so the
options, defaults and help are the same in both."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_commands", "run", "HelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for options with a real default (not for required options,
    flags or options whose help says what an absent value means). The ``probformer``
    command uses it for every verb."""

    def _get_help_string(self, action):
        text = action.help or ""
        absent = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if absent or action.required or "default" in text:
            return text
        return super()._get_help_string(action)


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers such as 64,128,256, got {text!r}") from None
    if len(set(widths)) < 2 or min(widths) < 4:
        raise argparse.ArgumentTypeError(f"expected at least two different widths, each >= 4, got {text!r}")
    return sorted(set(widths))  # ascending: "the two widest" are the last two


def add_commands(commands, **parser_options) -> None:
    """Add ``coord-check`` and ``neighbourhood`` to the sub-parsers ``commands``
    (``parser_options``, e.g. the help formatter, go to each parser)."""
    check = commands.add_parser(
        "coord-check",
        help="activation sizes vs width, standard and μP, both paradigms",
        description="Train a few steps at each width and plot every activation group's size: flat under μP.",
        **parser_options,
    )
    check.add_argument(
        "--out",
        default="runs/coord-check",
        help="folder for coord_check.json and the PNGs (docs/mup holds the documented ones; pass it to refresh them)",
    )
    check.add_argument("--widths", type=_widths, default="64,128,256,512,1024", help="comma-separated widths")
    check.add_argument("--steps", type=int, default=5, help="AdamW steps per width")
    check.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    search = commands.add_parser(
        "neighbourhood",
        help="random search around a tuned point: the base point's rank",
        description="Perturb lr and the six information weights around a run config's values; rank the base point.",
        **parser_options,
    )
    search.add_argument("--config", required=True, help="a probabilistic_transformer TOML run config")
    search.add_argument(
        "--samples", type=int, default=None, help="perturbed runs (default: the smallest n with 0.95^n <= 0.05, 59)"
    )
    search.add_argument("--radius", type=float, default=0.5, help="relative half-width of the interval")
    search.add_argument("--seed", type=int, default=0, help="seed of the perturbations")
    search.add_argument("--out", help="JSON report path (default: none written)")


def check_arguments(args) -> None:
    """Every argument checked before any import or work (``ValueError`` naming it)."""
    if args.mup_command == "coord-check":
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        if not 0 < args.lr < float("inf"):
            raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a file; coord-check writes a folder")
        return
    if not Path(args.config).is_file():
        raise FileNotFoundError(f"config file {args.config} does not exist")
    if args.samples is not None and args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if not 0 < args.radius < 1:
        raise ValueError(f"--radius must lie in (0, 1), got {args.radius}")


def run(args) -> int:
    """Run the verb ``args.mup_command`` parsed by ``add_commands``."""
    check_arguments(args)  # before importing torch
    import torch

    torch.set_num_threads(1)
    if args.mup_command == "coord-check":
        from probformer.mup import coord_check

        widths = args.widths if isinstance(args.widths, list) else _widths(args.widths)
        coord_check.main(args.out, widths=widths, steps=args.steps, lr=args.lr)
        out = Path(args.out)
        print(f"wrote {out / 'coord_check.json'}, {out / 'coord_check_channels.png'}, {out / 'coord_check_rank.png'}")
        return 0
    from probformer.mup import neighbourhood

    neighbourhood.run(args.config, args.samples, args.radius, args.seed, args.out)
    return 0
