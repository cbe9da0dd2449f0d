"""``benchmarks/mean_field.py --against REV``: the fused iteration of this checkout (or of
git ``--current``) against git revision REV's, each tree extracted with ``git archive`` and
run in alternating fresh processes (one tree's packages per process)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

_TIME_FUSED = """
import sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads({threads})
import graphs, inference
assert inference.__file__.startswith({root!r}), inference.__file__
torch.manual_seed(0)
crf = graphs.CRF(vocab_size=1000, labels=256, channels=8, rank=64, topology="full", gamma=3)
engine = inference.MeanField(crf, iterations=4, kernel="fused", weights="reference")
tokens = torch.randint(0, 1000, ({B}, {n}))
best = float("inf")
for i in range({steps} + 1):
    start = time.perf_counter()
    engine(tokens).logits.square().mean().backward()
    if i:  # the first step is a warm-up
        best = min(best, time.perf_counter() - start)
print(best)
"""


def extract_revision(revision: str, here: str, into: str) -> str:
    """Git ``revision`` of the repository at ``here`` extracted into ``into``: its full commit."""
    commit = subprocess.run(["git", "rev-parse", revision], cwd=here, capture_output=True, text=True, check=True)
    archive = subprocess.run(["git", "archive", commit.stdout.strip()], cwd=here, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return commit.stdout.strip()


def against(revision: str, rounds: int, threads: int, shapes=((128, 8), (512, 8)), current: str | None = None) -> dict:
    """The fused iteration of this checkout (or of git ``current``) vs git ``revision``'s,
    in alternating processes."""
    import tempfile

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as old, tempfile.TemporaryDirectory() as new:
        commit = extract_revision(revision, here, old)
        name = extract_revision(current, here, new)[:10] if current else "this checkout"
        new = new if current else here
        results = {"revision": commit, "current": name, "rounds": rounds, "rows": []}
        print(f"fused forward+backward, T = 4, d = 256, C = 8, r = 64: {name} vs {commit[:10]}\n")
        print(f"| n | B | {name} s | {commit[:10]} s | ratio |")
        print("|---|---|---|---|---|")
        for n, B in shapes:
            best = {"new": math.inf, "old": math.inf}
            steps = 3 if n <= 128 else 1
            for _ in range(rounds):
                for tree, root in (("new", new), ("old", old)):
                    code = _TIME_FUSED.format(root=root, threads=threads, B=B, n=n, steps=steps)
                    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
                    if out.returncode:
                        raise RuntimeError(f"{tree} tree failed:\n{out.stderr[-2000:]}")
                    best[tree] = min(best[tree], float(out.stdout.split()[-1]))
            row = {"n": n, "B": B, "new": best["new"], "old": best["old"], "ratio": best["new"] / best["old"]}
            results["rows"].append(row)
            print(f"| {n} | {B} | {row['new']:.3f} | {row['old']:.3f} | {row['ratio']:.3f} |")
    return results
