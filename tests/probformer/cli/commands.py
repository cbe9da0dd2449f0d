"""The ``probformer`` command as a user runs it (a subprocess of this interpreter, one
thread, the repository importable) and the tiny run config (tests/builders.py's
``TINY_PT_RUN``) written with some of its lines replaced."""

import os
import subprocess
import sys
from pathlib import Path

from tests.builders import TINY_PT_RUN as TINY

ROOT = Path(__file__).resolve().parents[3]


def probformer(*args, cwd, timeout=120):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "probformer", *map(str, args)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tiny_config(folder: Path, name="run.toml", steps=2, **replacements) -> Path:
    text = TINY.format(dropout=0.1, source="ptb", task="mlm", max_length=90, steps=steps)
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    path = folder / name
    path.write_text(text)
    return path
