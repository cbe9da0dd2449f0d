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


def test_the_profile_and_precision_scripts_dry_run_on_the_cpu(tmp_path, capsys, monkeypatch):
    """benchmarks/gpu_profile.py and benchmarks/flex_precision.py, the GPU run's follow-ups,
    run with the dry run's sizes on the CPU; the precision script's float32 logits agree with
    the float64 fused kernel there (no tensor cores: ieee arithmetic on the CPU)."""
    from benchmarks import flex_precision, gpu_profile
    from inference.mean_field.kernels import flex as flex_module

    precision = flex_module._CUDA_FLOAT32_PRECISION
    monkeypatch.setattr(flex_module, "_CUDA_FLOAT32_PRECISION", precision)  # restored after the test

    out = tmp_path / "profile.txt"
    # every row, so that aten:: ops are listed however the custom autograd functions rank on a busy machine
    argv = ["--device", "cpu", "--tiny", "--n", "16", "--rows", "1000", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["gpu_profile", *argv])
    gpu_profile.main()
    assert "seconds per step without profiler" in out.read_text() and "aten::" in out.read_text()
    capsys.readouterr()
    monkeypatch.setattr(
        "sys.argv", ["flex_precision", "--device", "cpu", "--tiny", "--lengths", "16", "--threads", "1"]
    )
    flex_precision.main()
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["n"] == 16 and row["pt_s"] > 0 and row["layer_s"] > 0
    assert row["relative_logit_error"] < 1e-5


def test_only_a_synchronising_call_counts_as_a_host_sync():
    """The first GPU loop counted CUDA's notice that sync debug mode is a prototype (raised once,
    in set_sync_debug_mode) as a sync: the count is of the warnings that name a synchronising call."""
    import warnings

    from benchmarks.gpu_check_stages import sync_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for message in (
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
            "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)",
            "called a synchronizing CUDA operation (Triggered internally at c10/cuda/...)",
            "an unrelated warning",
        ):
            warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message)[:37] for w in sync_warnings(caught)] == ["called a synchronizing CUDA operation"]


def test_the_sync_site_script_needs_a_cuda_device():
    import pytest

    from benchmarks import gpu_sync_sites

    with pytest.raises(SystemExit, match="a CUDA device is needed"):
        gpu_sync_sites.main(["--device", "cpu"])


def test_the_flex_options_script_dry_runs_and_undoes_each_variant(tmp_path):
    """benchmarks/flex_options.py on the CPU: every (topology, variant) line written in the
    order given, each variant's options added to the engine's and taken back after it. The
    CPU runs the fused kernel, which reads no kernel option: every variant after the default
    has logits equal to the default's exactly; one before it has no difference to give."""
    from benchmarks import flex_options
    from inference.mean_field.kernels import flex

    before = dict(flex._KERNEL_OPTIONS), flex._MASK_BLOCK
    out = tmp_path / "options.jsonl"
    argv = ["--device", "cpu", "--tiny", "--n", "16", "--topologies", "full", "window(2)", "--variants", "warps_8",
            "default", "mask_64", "warps_8", "--out", str(out)]  # fmt: skip
    lines = flex_options.main(argv)
    assert [(line["topology"], line["variant"]) for line in lines] == [
        (t, v) for t in ("full", "window(2)") for v in ("warps_8", "default", "mask_64")
    ]
    assert all("error" not in line and line["step_s"] > 0 for line in lines), lines
    assert [line["logit_difference"] for line in lines] == [None, None, 0.0] * 2
    assert len(out.read_text().splitlines()) == 6 and (dict(flex._KERNEL_OPTIONS), flex._MASK_BLOCK) == before
