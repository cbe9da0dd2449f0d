"""``placement.hold_freed_memory``: after it, a large block freed and allocated again is
served from the pages already there (no new page faults, counted by the kernel's
``ru_minflt``); without it, glibc maps fresh pages for the block every time. Each case runs
in a fresh interpreter: the setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# a training loop's pattern: blocks of 64 MiB and 12 MiB allocated, touched and freed, 30
# times; the minor page faults of each round are the pages the kernel zeroed afresh, and
# the resident memory after rounds 10 and 30 shows whether the held heap keeps growing
SCRIPT = """
import json, resource, sys
import torch
from probformer.training.placement import hold_freed_memory
applied = hold_freed_memory() if sys.argv[1] == "hold" else None
faults, resident = [], {}
for round in range(1, 31):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    large, small = torch.empty(16 * 2**20).fill_(1.0), torch.empty(3 * 2**20).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del large, small
    if round in (10, 30):
        resident[round] = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])  # KiB
print(json.dumps({"applied": applied, "faults": faults, "resident": resident}))
"""


def _faults(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _huge_pages_always() -> bool:
    """Transparent huge pages for every mapping: a block faults in 2 MiB pages, not 4 KiB."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.is_file() and "[always]" in setting.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
@pytest.mark.skipif(
    _huge_pages_always(), reason="transparent huge pages 'always': faults are not counted in 4 KiB pages"
)
def test_freed_blocks_are_reused_without_new_page_faults_and_the_heap_settles():
    pages = 19 * 2**20 * 4 // 4096  # both blocks
    default, held = _faults("default"), _faults("hold")
    assert held["applied"] is True
    assert min(default["faults"][-10:]) > pages // 2  # fresh pages every round without it
    assert max(held["faults"][-10:]) < pages // 100  # the same pages again with it
    assert held["resident"]["30"] - held["resident"]["10"] < 8 * 1024  # KiB: no growth past round 10


def test_elsewhere_nothing_changes_and_false_is_returned(monkeypatch):
    from probformer.training import placement

    monkeypatch.setattr(placement.sys, "platform", "darwin")
    assert placement.hold_freed_memory() is False


def test_the_trainer_key_is_an_opt_in_bool_that_a_resume_may_change():
    from probformer.training.resume import RESUMABLE_CHANGES
    from probformer.training.run_config import TrainConfig

    assert TrainConfig().hold_freed_memory is False and "hold_freed_memory" in RESUMABLE_CHANGES
    with pytest.raises(TypeError, match="hold_freed_memory"):
        TrainConfig(hold_freed_memory="yes")


@pytest.mark.parametrize("hold", [False, True])
def test_the_trainer_holds_freed_memory_on_the_cpu_only_when_asked(hold, tmp_path, monkeypatch, capsys):
    """The setting is process-wide and has no undo: the trainer asks for it only with the key
    (the call is counted here, not made: this test process keeps glibc's defaults)."""
    from probformer.training import placement, run_config
    from probformer.training.trainer import Trainer
    from tests.builders import write_tiny_run_config

    calls = []
    monkeypatch.setattr(placement, "hold_freed_memory", lambda: calls.append(1) or True)
    loaded = run_config.load(write_tiny_run_config(tmp_path, steps=1), [f"train.hold_freed_memory={str(hold).lower()}"])
    trainer = Trainer(loaded, tmp_path / "run")
    assert len(calls) == int(hold) and trainer.holds_freed_memory is hold
    trainer.run()
    assert ("freed memory held" in capsys.readouterr().out) is hold
