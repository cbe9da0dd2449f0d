"""Reliability benchmark: thousands of generated cases against every public
entry point, each outcome classified, written to docs/reliability.md and
docs/benchmarks/reliability.json.

    .venv/bin/python -m benchmarks.reliability            # the full run (~4,000 cases, ~8 min on 2 cores)
    .venv/bin/python -m benchmarks.reliability --quick    # about a tenth of the cases

Outcomes (a case is never counted twice):

- ok: valid input accepted; the output is finite and, where an oracle is cheap, right;
- clear error: a refusal of a user-facing type (ValueError, TypeError, FileNotFoundError,
  FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError, and probformer's
  WriteError for a failed write; for the CLI an exit status != 0 with a one-line message,
  no traceback) whose message names the offending argument, key or path (or the allowed
  values); each case lists the names that count;
- obscure error: any other exception, a clear type whose message names nothing useful,
  a valid input refused, or a crash of the worker process;
- silent NaN: non-finite output for finite input, or non-finite input accepted silently;
- silent wrong: an independent check disagrees (log Z by enumeration in float64, ELBO <=
  log Z, ESS of equal weights = N, outputs independent of padding, the fused kernel against
  the float64 naive one, arc masks from the documented table), or invalid input accepted;
- hang: the case exceeded its timeout (60 s unless the case says otherwise; every case
  runs in a forked worker process the parent kills then, and a new worker goes on);
- code executed: a crafted file made its payload run (the payload creates a marker file).

Cases are generated from a fixed seed (one ``random.Random`` per entry point), so the same
tree gives the same cases. Workers run under a 4 GiB address-space limit, so an absurd size
that is accepted fails at allocation (obscure) instead of swapping the machine.

Layout: ``harness`` (cases, classification, workers), ``fixtures`` (shared models and
mutations), one module per family of entry points (models, factor_graphs, engines,
samplers, diagnostics, run_configs, checkpoints, artefacts, command_line, non_finite), with
``folder_damage`` (the damage to a saved folder that checkpoints and artefacts share) and
``pt2_crafting`` (the crafted .pt2 archives), and here the plan and the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.reliability.artefacts import export_cases, load_cases
from benchmarks.reliability.checkpoints import checkpoint_cases, save_cases
from benchmarks.reliability.command_line import cli_cases
from benchmarks.reliability.diagnostics import diversity_cases, ess_cases, pareto_cases, report_cases
from benchmarks.reliability.engines import exact_cases, mean_field_cases
from benchmarks.reliability.factor_graphs import crf_cases, topology_cases
from benchmarks.reliability.fixtures import KINDS, classes
from benchmarks.reliability.harness import ROOT, Case, run_cases
from benchmarks.reliability.models import config_cases, forward_cases, pt_variant_cases
from benchmarks.reliability.non_finite import non_finite_cases
from benchmarks.reliability.report import summarise, write_markdown
from benchmarks.reliability.run_configs import run_config_cases
from benchmarks.reliability.samplers import gibbs_cases, smc_cases

SEED = 17


def warm_imports() -> None:
    """Import the heavy modules once in the parent, so forked workers inherit them and no
    case's time includes an import (jax is imported but never run here: safe to fork)."""
    import arviz  # noqa: F401

    import graphs  # noqa: F401
    import inference  # noqa: F401
    import probformer.deploy  # noqa: F401
    import probformer.diagnostics  # noqa: F401
    import probformer.training.checkpoint  # noqa: F401
    import probformer.training.run_config  # noqa: F401

    for kind in KINDS:
        classes(kind)


def run_plan(workdir: Path, scale: float, jobs: int, only: str = "", progress: bool = True) -> list[dict]:
    """Run every case (the exports first: they write the templates of the crafted files)."""
    (workdir / "markers").mkdir(parents=True, exist_ok=True)
    (workdir / "templates").mkdir(exist_ok=True)
    warm_imports()
    selected = lambda cases: [c for c in cases if only.lower() in c.entry.lower()]  # noqa: E731
    first = export_cases(workdir)
    if only and not any(word in only.lower() for word in ("export", "load")):
        first = []  # nothing selected needs the templates
    results = run_cases(first, jobs, progress)
    cases = selected(plan(scale, workdir))
    if progress:
        print(f"{len(first)} export cases, then {len(cases)} cases, {jobs} workers", file=sys.stderr)
    return results + run_cases(cases, jobs, progress)


def plan(scale: float, workdir: Path) -> list[Case]:
    """Every case after the exports, in a fixed order; ``scale`` shrinks the counts (``--quick``)."""
    import random

    def n(count: int) -> int:
        return max(1, round(count * scale))

    cases: list[Case] = []
    for kind in KINDS:
        cases += config_cases(random.Random(f"{SEED}-config-{kind}"), kind, n(130))
        cases += forward_cases(random.Random(f"{SEED}-forward-{kind}"), kind, n(110))
    for generator, count in GENERATORS:
        cases += generator(random.Random(f"{SEED}-{generator.__name__}"), n(count), workdir)
    return cases


GENERATORS: list[tuple[Callable, int]] = [  # (generator(rng, count, workdir), full count)
    (pt_variant_cases, 150),
    (topology_cases, 400),
    (crf_cases, 200),
    (exact_cases, 200),
    (mean_field_cases, 220),
    (smc_cases, 200),
    (gibbs_cases, 50),
    (ess_cases, 200),
    (pareto_cases, 120),
    (diversity_cases, 120),
    (report_cases, 60),
    (run_config_cases, 320),
    (checkpoint_cases, 320),
    (save_cases, 40),
    (load_cases, 260),
    (cli_cases, 16),
    (non_finite_cases, 3000),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset (about a tenth of the cases)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--only", default="", help="run only entry points whose name contains this text")
    parser.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "reliability.json"))
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "reliability.md"), help="'' to skip it")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="probformer-reliability-") as workdir:
        results = run_plan(Path(workdir), 0.1 if args.quick else 1.0, args.jobs, args.only)
    seconds = time.monotonic() - started
    summary = summarise(results)
    command = ".venv/bin/python -m benchmarks.reliability" + (" --quick" if args.quick else "")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"summary": summary, "seconds": round(seconds, 1)})[:-1]
        rows = ",\n".join(json.dumps(result) for result in results)  # one case a line: diffs stay readable
        Path(args.json).write_text(f'{head}, "results": [\n{rows}\n]}}\n')
    if args.markdown:
        write_markdown(results, summary, Path(args.markdown), command, seconds, args.jobs)
    print(json.dumps(summary["totals"]), f"{summary['cases']} cases in {seconds:.0f} s")
    return 0
