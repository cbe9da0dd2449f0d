"""The ``probformer`` command started as a child process (``subprocess.Popen``, one thread),
as the trainer tests that kill a run, or read its exit status and stderr, start it."""

import os
import subprocess
import sys


def cli(*args, env=None, **kwargs):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "probformer", *args], env=environment, **kwargs)
