"""``benchmarks/long_context.py --topologies --against REV``: each topology's time over full
for this checkout and for git revision REV, in alternating fresh
processes, each running its own tree's ``long_context.py --topologies`` with that tree's
packages (``PYTHONPATH`` set to it and checked: an editable install would otherwise import
the checkout in both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from benchmarks.mean_field_against import extract_revision

# runs one tree's benchmark after checking that its own packages are the ones imported
_RUN_TREE = """
import runpy, sys
root, argv = sys.argv[1], sys.argv[2:]
import inference, probformer
for module in (inference, probformer):
    assert module.__file__.startswith(root), module.__file__
sys.argv = argv
runpy.run_path(argv[0], run_name="__main__")
"""


def _run(root: str, n: int, rounds: int, out: str, default_malloc: bool) -> dict:
    script = os.path.join(root, "benchmarks", "long_context.py")
    command = [sys.executable, "-c", _RUN_TREE, root, script, "--topologies", "--n", str(n), "--rounds", str(rounds)]
    command += ["--out", out] + (["--default-malloc"] if default_malloc else [])
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the tree at {root} failed:\n{done.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def against(revision: str, n: int, rounds: int, pairs: int, default_malloc: bool = False) -> dict:
    """``pairs`` alternations of REV's run and this checkout's (REV first in each pair); each
    run holds freed memory as the benchmark does unless ``default_malloc``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as old, tempfile.TemporaryDirectory() as results:
        commit = extract_revision(revision, here, old)
        runs = {"old": [], "new": []}
        for pair in range(pairs):
            for tree, root in (("old", old), ("new", here)):
                out = os.path.join(results, f"{tree}-{pair}.json")
                runs[tree].append(_run(root, n, rounds, out, default_malloc))
    topologies = list(runs["new"][0]["over_full"])
    print(f"\nn = {n}, min of {rounds}, {pairs} alternation(s); each topology's time over full's, run by run:\n")
    print(f"| topology | {commit[:10]} | this checkout |")
    print("|---|---|---|")
    for t in topologies:
        cells = [", ".join(f"{run['over_full'][t]:.3f}" for run in runs[tree]) for tree in ("old", "new")]
        print(f"| {t} | {cells[0]} | {cells[1]} |")
    seconds = [", ".join(f"{run['seconds']['full']:.3f}" for run in runs[tree]) for tree in ("old", "new")]
    print(f"| full (seconds) | {seconds[0]} | {seconds[1]} |")
    return {"revision": commit, "current": "this checkout", "n": n, "rounds": rounds, "pairs": pairs, "runs": runs}
