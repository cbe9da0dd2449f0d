"""Structure that means something. Two studies on UD English-EWT, every run one
epoch of EWT train (392 steps of 32 sentences), seed 0, configs in configs/structure/:

- UAS: do locality priors (``window(k) | root()`` topologies, a learned adaptive span)
  make the PT's argmax heads beat the right-neighbour baseline on EWT dev, at no more
  than +2% masked perplexity? MLM-trained (``mlm-*``) and UPOS-trained (``pos-*``) PTs.
  Beside the library's UAS (``evaluate --task uas``) each run records where its argmax
  heads go (ROOT, previous word, next word, farther), and the study records what the
  gold trees allow: the share of gold heads at each offset and the ceiling of a
  topology that only reaches distance k (or ROOT).
- ACT (``act-tau-*``): UPOS tagging with ``halting = "act"`` over at most 6 iterations,
  ponder cost tau on a log grid; per run the tagging accuracy and, on EWT dev, the
  per-token number of iterations N(t): mean, sd, min, max, share off the mode, and its
  mean by UPOS tag and by training-frequency bucket of the word.

    PROBFORMER_EWT=/path/to/ud-english-ewt .venv/bin/python benchmarks/structure.py
    .venv/bin/python benchmarks/structure.py --only mlm-full-root,mlm-window1-root
    .venv/bin/python benchmarks/structure.py --report

Resumable: a run already in docs/benchmarks/structure.json is skipped (``--rerun`` to
redo it); the file is rewritten after every run. Runs go to runs/structure/<config>.

Layout: the study's runs (configs/structure/<name>.toml) in ``structure_runs``, what is
measured of the gold trees and of a trained run in ``structure_analysis``, the markdown
tables in ``structure_report``; here the training, the analysis of each run and the
command line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())  # the tree it is run in (benchmarks/structure.py is run as a script)
from benchmarks.structure_analysis import depth_by_token, gold_offsets, head_destinations, unigram_mlm  # noqa: E402
from benchmarks.structure_report import report  # noqa: E402
from benchmarks.structure_runs import ACT_RUNS, CONFIGS, OUT, UAS_RUNS  # noqa: E402


def run_one(name: str, steps: int = 0) -> dict:
    from probformer.training import run_config
    from probformer.training.trainer import train

    config = run_config.load(CONFIGS / f"{name}.toml")
    if steps:  # --smoke: a short check of the script, never recorded
        import dataclasses

        config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))
    run = Path("runs/structure") / name
    if run.exists():
        import shutil

        shutil.rmtree(run)
    started = time.time()
    summary = train(config, run, progress=False)
    row = {**summary, "command": f"probformer train --config {CONFIGS}/{name}.toml"}
    row.update(analyse(name, run))
    row["wall_seconds"] = time.time() - started
    return row


def analyse(name: str, run: Path, uas: bool = True) -> dict:
    """What a trained run's heads or halting did on EWT dev (``uas=False``: not the
    library's UAS again)."""
    from probformer.training import data, run_config
    from probformer.training.evaluate import evaluate, load_any

    config = run_config.load(CONFIGS / f"{name}.toml")
    row = {"topology": config.model["topology"]}
    model, vocabulary = load_any(run)
    dev = data.read_conllu(data.ewt_path("dev"))
    if name.startswith("act-"):
        train_counts = Counter(w for tree in data.read_conllu(data.ewt_path("train")) for w in tree.words)
        row["depth"] = depth_by_token(model, vocabulary, dev, train_counts)
        row["ponder_cost"] = config.model["ponder_cost"]
    else:
        if uas:
            row["uas"] = evaluate(run, "uas", "ewt")
        row["head_destinations"] = head_destinations(model, vocabulary, dev)
        if model.mean_field.span is not None:
            row["learned_spans"] = model.mean_field.spans().tolist()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated config names (default: every run)")
    parser.add_argument("--rerun", action="store_true", help="redo runs already in the results")
    parser.add_argument("--report", action="store_true", help="print the markdown tables and exit")
    parser.add_argument("--reanalyse", action="store_true", help="redo the analysis of finished runs, no training")
    parser.add_argument("--smoke", type=int, default=0, help="a check of the script: N steps, results to /tmp")
    args = parser.parse_args()
    out = Path("/tmp/structure-smoke.json") if args.smoke else OUT
    results = json.loads(out.read_text()) if out.is_file() and not args.smoke else {}
    if args.report:
        print(report(results))
        return
    torch.set_num_threads(1)
    from probformer.training import data

    results["gold"] = gold_offsets(data.read_conllu(data.ewt_path("dev")))  # cheap, and new rules land
    names = args.only.split(",") if args.only else UAS_RUNS + ACT_RUNS
    if args.reanalyse:
        for name in names:
            if name in results.get("runs", {}):
                results["runs"][name].update(analyse(name, Path("runs/structure") / name, uas=False))
                out.write_text(json.dumps(results, indent=1))
        return
    if "unigram_mlm" not in results and (Path("runs/structure/mlm-full-root") / "model").is_dir():
        results["unigram_mlm"] = unigram_mlm(Path("runs/structure/mlm-full-root"))
    for name in names:
        if name in results.get("runs", {}) and not args.rerun:
            continue
        row = run_one(name, args.smoke)
        row["code"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        results.setdefault("runs", {})[name] = row
        print(json.dumps({k: v for k, v in row.items() if k not in ("depth", "head_destinations")}), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
