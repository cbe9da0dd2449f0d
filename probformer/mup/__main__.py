"""``python -m probformer.mup coord-check | neighbourhood``: the same verbs as
``probformer mup coord-check | neighbourhood`` (probformer.mup.commands)."""

from __future__ import annotations

import argparse
import sys

from probformer.mup import commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m probformer.mup",
        description="μP tooling (also: probformer mup ...)",
        formatter_class=commands.HelpFormatter,
    )
    verbs = parser.add_subparsers(dest="mup_command", required=True, metavar="VERB")
    commands.add_commands(verbs, formatter_class=commands.HelpFormatter)
    return commands.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
