"""The GPU check's dry run: the same script on the CPU with tiny sizes (so it cannot rot
between the GPUs it is run on), its report and its section of the benchmarks page."""

import json

from benchmarks import gpu_check
from benchmarks.gpu_check_stages import TINY


def test_the_dry_run_measures_every_stage_and_writes_its_section(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\nbefore\n\n{gpu_check.BEGIN}\nold figures\n{gpu_check.END}\n\nafter\n")
    report = gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "gpu.json"), "--markdown", str(page)])
    assert json.loads((tmp_path / "gpu.json").read_text())["tiny"] is True
    results = report["results"]
    for stage in ("matmul_peak", "pt_against_layer", "topology_ratios", "memory_growth", "smc", "training"):
        assert "error" not in results[stage] and "not_run" not in results[stage], (stage, results[stage])
    assert [(row["n"], row["form"]) for row in results["pt_against_layer"]] == [
        (n, form) for n in TINY.lengths for form in ("grouped", "shared")
    ]
    assert results["smc"]["ratio"] > 0 and results["training"]["recompiles_after_warmup"] == 0
    text = page.read_text()
    assert "old figures" not in text and text.startswith("# Benchmarks\n\nbefore") and text.rstrip().endswith("after")
    assert text.count(gpu_check.BEGIN) == 1 and "| SMC / SMCFilter" in text


def test_test_modules_importing_a_missing_package_are_left_out_by_name():
    left_out = gpu_check.left_out_test_modules(["pyro"])
    assert "tests/inference/smc/test_pyro_state_space.py" in left_out  # it imports pyro at module level
    assert not set(gpu_check.CUDA_TEST_FILES) & set(left_out)
    assert gpu_check.left_out_test_modules([]) == []
