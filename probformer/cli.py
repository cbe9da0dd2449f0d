"""The ``probformer`` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probformer", description="Transformers from inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="oracles on a real sentence, then a short PT training run on PTB")
    demo.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from probformer import demo as demo_module

        return demo_module.main(args.seconds)
    return 2
