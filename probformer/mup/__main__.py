"""``python -m probformer.mup coord-check --out DIR`` and
``python -m probformer.mup neighbourhood --config FILE [--samples n]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probformer.mup", description="μP tooling")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("coord-check", help="activation sizes vs width, standard and μP, both paradigms")
    check.add_argument("--out", required=True, help="folder for coord_check.json and the PNGs")
    check.add_argument("--widths", default="64,128,256,512,1024", help="comma-separated widths")
    check.add_argument("--steps", type=int, default=5)
    check.add_argument("--lr", type=float, default=1e-2)
    search = commands.add_parser("neighbourhood", help="random search around a tuned point: the base point's rank")
    search.add_argument("--config", required=True, help="a probabilistic_transformer TOML run config")
    search.add_argument("--samples", type=int, default=None, help="default: smallest n with 0.95^n <= 0.05 (59)")
    search.add_argument("--radius", type=float, default=0.5, help="relative half-width of the interval (0.5)")
    search.add_argument("--seed", type=int, default=0)
    search.add_argument("--out", help="JSON report path")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.command == "coord-check":
        from probformer.mup import coord_check

        widths = [int(w) for w in args.widths.split(",")]
        coord_check.main(args.out, widths=widths, steps=args.steps, lr=args.lr)
        return 0
    from probformer.mup import neighbourhood

    neighbourhood.run(args.config, args.samples, args.radius, args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
