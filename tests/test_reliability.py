"""The reliability suite (benchmarks/reliability/, which writes docs/reliability.md).

First the instrument itself: every outcome class is produced by a case built to produce
it, so a failure below is the library's, not a misreading. Then a fast subset of the
benchmark's generated cases (and the crafted .pt2 payloads, both known
code-execution attacks among them) with the hard targets: no code executed, no silent
NaN, no silent wrong number, no hang. The full benchmark (>= 3,000 cases, <= 1% obscure
errors) is the slow test.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import pytest
import torch

from benchmarks import reliability as bench
from benchmarks.reliability import artefacts, diagnostics, engines, factor_graphs, fixtures, harness, non_finite

HARD_TARGETS = ("code executed", "silent NaN", "silent wrong", "hang")


def outcomes_of(cases: list[harness.Case], jobs: int = 1) -> list[dict]:
    return harness.run_cases(cases, jobs, progress=False)


def failures(results: list[dict], kinds=HARD_TARGETS) -> list[str]:
    return [f"{r['entry']}: {r['label']} -> {r['outcome']}: {r['detail']}" for r in results if r["outcome"] in kinds]


# ---- the instrument -------------------------------------------------------------------


def _raise(error: BaseException):
    def run():
        raise error

    return run


def _sleep():
    time.sleep(30)


def _unpickle_payload(marker: str):
    import pickle

    return lambda: pickle.loads(fixtures.payload_pickle(marker))


def _crash():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_every_outcome_is_recognised(tmp_path: Path):
    marker = str(tmp_path / "marker")
    cases = [
        (harness.Case("t", "accepted, finite", lambda: torch.ones(3), expect="accept"), "ok"),
        (
            harness.Case("t", "named key", _raise(ValueError("config key 'width' must be >= 1")), names=("width",)),
            "clear error",
        ),
        (
            harness.Case("t", "path", _raise(FileNotFoundError("/x/config.json is missing")), names=("config.json",)),
            "clear error",
        ),
        (harness.Case("t", "names nothing", _raise(ValueError("bad value")), names=("width",)), "obscure error"),
        (harness.Case("t", "not a user type", _raise(RuntimeError("width is bad")), names=("width",)), "obscure error"),
        (harness.Case("t", "KeyError", _raise(KeyError("width")), names=("width",)), "obscure error"),
        (
            harness.Case("t", "valid refused", _raise(ValueError("width")), expect="accept", names=("width",)),
            "obscure error",
        ),
        (harness.Case("t", "worker crash", _crash), "obscure error"),
        (harness.Case("t", "NaN out", lambda: {"x": torch.tensor([1.0, math.nan])}, expect="accept"), "silent NaN"),
        (harness.Case("t", "NaN accepted", lambda: 1, accepted="silent NaN"), "silent NaN"),
        (
            harness.Case("t", "oracle", lambda: 2, expect="either", check=lambda x: ("silent wrong", "2 != 3")),
            "silent wrong",
        ),
        (harness.Case("t", "invalid accepted", lambda: torch.ones(2)), "silent wrong"),
        (harness.Case("t", "sleeps", _sleep, timeout=1.0), "hang"),
        (harness.Case("t", "subprocess past its limit", _raise(harness.Hang("ran past 5 s"))), "hang"),
        (
            harness.Case("t", "CLI traceback", _raise(harness.CliTraceback("ValueError: width")), names=("width",)),
            "obscure error",
        ),
        (
            harness.Case("t", "payload", _unpickle_payload(marker), expect="either", marker=marker, finite=False),
            "code executed",
        ),
    ]
    results = outcomes_of([case for case, _ in cases], jobs=2)
    found = [(r["label"], r["outcome"]) for r in results]
    assert found == [(case.label, outcome) for case, outcome in cases]


def test_oracles_agree_with_hand_computed_values():
    # the topology oracle, written from the docs' table, on cases worked out by hand
    window = factor_graphs.topology_oracle("window", [1], 3)
    assert window.tolist() == [[False, True, False], [True, False, True], [False, True, False]]
    star = factor_graphs.topology_oracle("star", [], 2)  # tokens 0, 1 and the relay 2
    assert star.tolist() == [[False, True, True], [True, False, True], [True, True, False]]
    # log Z by enumeration: one token, no heads possible, two labels -> logsumexp of the unary row
    crf = engines.random_crf(random.Random(0), 1.0, topology="full")
    crf.global_labels = 0
    crf.binary = None
    tokens = torch.tensor([[3]])
    expected = torch.logsumexp(crf.unary[3].double(), 0).item()
    assert engines.brute_force_log_partition(crf, tokens) == pytest.approx(expected, abs=1e-9)
    # ESS of equal log weights is N exactly, in float64 from any offset
    assert diagnostics.ess_reference(torch.full((1, 3), 1e4)).item() == 3.0


# ---- the library: a fast subset -----------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A benchmark work folder holding a .pt2 export of the tiny PT (~15 s, once)."""
    folder = tmp_path_factory.mktemp("reliability")
    (folder / "markers").mkdir()
    (folder / "templates").mkdir()
    bench.warm_imports()
    exports = [c for c in artefacts.export_cases(folder) if c.label == "PT -> .pt2"]
    results = outcomes_of(exports)
    assert [r["outcome"] for r in results] == ["ok"], f"probformer.export to .pt2 failed: {results}"
    return folder


def test_crafted_archives_run_code_under_a_naive_loader(workdir: Path):
    """The two attacks, rebuilt: a duplicate entry whose first copy is a pickle, and an
    opaque_obj constant. Loaded with plain torch.export.load their payload runs, so the
    benchmark's "0 code executed" on probformer.load means something."""
    cases = []
    for choice in ("dup sample", "opaque"):
        marker = str(workdir / "markers" / f"naive-{choice.replace(' ', '-')}")
        label, entries, _ = artefacts.pt2_attack(
            None, artefacts.zip_entries(workdir / "templates" / "pt.pt2"), marker, choice
        )
        path = workdir / f"naive-{choice.replace(' ', '-')}.pt2"
        artefacts.write_pt2(path, entries)
        cases.append(
            harness.Case(
                "torch.export.load",
                label,
                lambda path=path: torch.export.load(str(path)),
                expect="either",
                marker=marker,
                finite=False,
            )
        )
    assert [r["outcome"] for r in outcomes_of(cases)] == ["code executed", "code executed"]


def test_fast_subset_meets_the_hard_targets(workdir: Path):
    """About 200 generated cases over every entry point but the slow ones (Gibbs, the CLI,
    exported files), plus every crafted .pt2 payload."""
    slow = ("inference.Gibbs", "probformer CLI", "probformer.load (.pt2)", "probformer.load (.onnx)")
    cases = [c for c in bench.plan(0.05, workdir) if c.entry not in slow and "calling a" not in c.entry]
    cases += artefacts.code_execution_cases(workdir)
    assert len(cases) >= 180 and sum("attack" in c.label for c in cases) == len(artefacts.PT2_PAYLOADS)
    results = outcomes_of(cases, jobs=2)
    assert not failures(results), "\n".join(failures(results))


def test_non_finite_input_is_refused_naming_the_argument_at_every_entry_point(workdir: Path):
    """NaN / inf at every public entry point (embeddings, hidden states, CRF and model
    parameters, SMC increments, diagnostics, a loaded export's tokens): no silent NaN and
    no refusal that fails to name the argument (an obscure error)."""
    cases = non_finite.non_finite_cases(random.Random("non-finite"), 160, workdir)
    entries = {c.entry for c in cases}
    for family in ("embeddings", "CRF parameters", "PTLayer", "forward", "increments", "diagnostics", "calling a pt2"):
        assert any(family in entry for entry in entries), family
    assert all(f"{kind}.forward" in " ".join(entries) for kind in fixtures.KINDS)
    results = outcomes_of(cases, jobs=2)
    bad = failures(results, HARD_TARGETS + ("obscure error",))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_full_benchmark_meets_every_target(tmp_path: Path):
    """The whole benchmark (about 10 minutes on 2 cores): what docs/reliability.md reports."""
    results_path = tmp_path / "reliability.json"
    assert bench.main(["--json", str(results_path), "--markdown", ""]) == 0
    import json

    results = json.loads(results_path.read_text())["results"]
    assert len(results) >= 3000
    assert not failures(results), "\n".join(failures(results)[:50])
    obscure = [r for r in results if r["outcome"] == "obscure error"]
    assert len(obscure) <= 0.01 * len(results), "\n".join(failures(obscure, ("obscure error",))[:50])
