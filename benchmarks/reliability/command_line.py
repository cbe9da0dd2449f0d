"""The probformer command line, run as subprocesses (few cases: each starts Python)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks.reliability.artefacts import call_check
from benchmarks.reliability.checkpoints import make_checkpoint_templates
from benchmarks.reliability.fixtures import forward, logits_of
from benchmarks.reliability.harness import ROOT, Case, CliLeftFolder, CliTraceback, Hang


def cli(args: list[str], cwd: Path, timeout: float, must_not_create: Path | None = None):
    """Run ``python -m probformer ARGS``; a failure becomes an exception the classifier reads:
    a one-line message (argparse's ``error:`` line included) a ValueError, a traceback a
    ``CliTraceback``, a failure that left ``must_not_create`` behind a ``CliLeftFolder``."""
    import subprocess

    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:  # subprocess.run kills the command at its timeout: no orphan outlives the case
        done = subprocess.run(
            [sys.executable, "-m", "probformer", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environment,
        )
    except subprocess.TimeoutExpired:
        raise Hang(f"python -m probformer {' '.join(args)} ran past {timeout:g} s (killed)") from None
    if done.returncode == 0:
        return {"stdout": done.stdout[-2000:]}
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"(nothing on stderr; exit status {done.returncode})"
    if must_not_create is not None and must_not_create.exists():
        raise CliLeftFolder(f"exit status {done.returncode} but {must_not_create} was created: {last}")
    if "Traceback (most recent call last)" in done.stderr:
        raise CliTraceback(f"traceback instead of a one-line error: {last}")
    if len(lines) > 3 and not (done.returncode == 2 and "error:" in last):
        raise CliTraceback(f"{len(lines)} lines on stderr: {last}")
    raise ValueError(last)


TINY_RUN = """
[model]
kind = "transformer"
width = 16
heads = 2
layers = 1
ffn_width = 32
dropout = 0.0

[data]
source = "train.txt"
max_length = 16
vocabulary = 60

[train]
batch_size = 8
lr = 1e-3
steps = 4
warmup_steps = 0
log_every = 1
"""


def cli_cases(rng, count: int, workdir: Path) -> list[Case]:
    folder = workdir / "cli"
    folder.mkdir()
    checkpoints = make_checkpoint_templates(workdir)
    pt, bert = str(checkpoints["probabilistic_transformer"]), str(checkpoints["transformer"])
    text = folder / "sentences.txt"
    text.write_text("w1 w2 w3 w4\nw5 w6 w7\nw8 w9 w10 w11 w12\n" * 20)
    base = (ROOT / "configs" / "demo-pt.toml").read_text()
    (folder / "broken.toml").write_text(base[: len(base) // 2] + "\n[[[")
    (folder / "lr-inf.toml").write_text(
        base.replace("[train]", "[train]\nlr = inf")
        if "lr =" not in base
        else "\n".join("lr = inf" if line.startswith("lr =") else line for line in base.splitlines())
    )
    (folder / "huge.toml").write_text(
        base.replace("[model]", "[model]\nchannels = 1000000000000")
        if "channels" not in base
        else "\n".join(
            "channels = 1000000000000" if line.startswith("channels") else line for line in base.splitlines()
        )
    )

    def case(label, args, expect="refuse", names=(), creates=None, timeout=120.0, check=None, before=None):
        def run():
            if before is not None:  # a command that must succeed first (in the same case: cases run in parallel)
                cli(before, folder, timeout / 2 - 5, None)
            return cli(args, folder, timeout / 2 - 5 if before else timeout - 5, creates)

        return Case(
            "probformer CLI", label, run, expect=expect, names=names, timeout=timeout, check=check, finite=False
        )

    words = [f"w{i}" for i in range(40)]
    order = __import__("random").Random(0)
    lines = (" ".join(order.choice(words) for _ in range(order.randint(3, 9))) for _ in range(200))
    (folder / "train.txt").write_text("\n".join(lines) + "\n")
    (folder / "tiny.toml").write_text(TINY_RUN)

    def run_check(out, run="run-t"):
        """One metrics line per logged step and one final line, none twice; the saved model loads."""
        from probformer.training import checkpoint

        rows = [json.loads(line) for line in (folder / run / "metrics.jsonl").read_text().splitlines()]
        steps = [row["step"] for row in rows if row.get("split") == "train"]
        finals = [row for row in rows if row.get("final")]
        if steps != [1, 2, 3, 4] or len(finals) != 1:
            return (
                "silent wrong",
                f"metrics.jsonl logs train steps {steps} and {len(finals)} final lines (want 1..4, 1)",
            )
        model, _ = checkpoint.load(folder / run / "model")
        model.eval()
        return call_check(lambda tokens, mask: logits_of(forward(model, tokens, mask)))

    def export_check(out):
        import probformer

        return call_check(probformer.load(folder / "exported"))

    cases = [
        case(
            "train: a tiny run (4 steps)",
            ["train", "--config", "tiny.toml", "--out", "run-t"],
            expect="accept",
            check=run_check,
        ),
        case(
            "train --resume: a finished run again",
            ["train", "--config", "tiny.toml", "--out", "run-r", "--resume"],
            expect="either",
            names=("finished", "complete", "already", "nothing to resume"),  # the only right reasons to refuse
            check=lambda out: run_check(out, "run-r"),
            before=["train", "--config", "tiny.toml", "--out", "run-r"],
            timeout=240.0,
        ),
        case("no command", [], names=("command", "required")),
        case(
            "train: config file missing",
            ["train", "--config", "missing.toml", "--out", "run-a"],
            names=("missing.toml",),
            creates=folder / "run-a",
        ),
        case(
            "train: broken TOML",
            ["train", "--config", "broken.toml", "--out", "run-b"],
            names=("broken.toml", "TOML"),
            creates=folder / "run-b",
        ),
        case(
            "train: lr = inf",
            ["train", "--config", "lr-inf.toml", "--out", "run-c"],
            names=("lr",),
            creates=folder / "run-c",
        ),
        case(
            "train: channels = 10**12",
            ["train", "--config", "huge.toml", "--out", "run-d"],
            names=("channels",),
            creates=folder / "run-d",
        ),
        case(
            "export: checkpoint missing", ["export", "nowhere", "--out", "x"], names=("nowhere",), creates=folder / "x"
        ),
        case("export: --format bogus", ["export", bert, "--format", "bogus", "--out", "y"], names=("format", "bogus")),
        case(
            "export: a checkpoint to a torch folder",
            ["export", bert, "--out", "exported"],
            expect="accept",
            check=export_check,
        ),
        case("evaluate: --task bogus", ["evaluate", pt, "--task", "bogus"], names=("task", "bogus")),
        case(
            "diagnose: --data missing",
            ["diagnose", pt, "--data", "missing.txt", "--out", "d1"],
            names=("missing.txt", "data"),
        ),
        case(
            "diagnose: --sentences 0",
            ["diagnose", pt, "--data", str(text), "--out", "d2", "--sentences", "0"],
            names=("sentences",),
        ),
        case(
            "diagnose: a PT checkpoint",
            ["diagnose", pt, "--data", str(text), "--out", "d3", "--sentences", "4"],
            expect="accept",
            timeout=180,
        ),
        case(
            "diagnose: a Transformer checkpoint",
            ["diagnose", bert, "--data", str(text), "--out", "d4", "--sentences", "4"],
            expect="accept",
            timeout=180,
        ),
        case("evaluate: mlm on a text file", ["evaluate", bert, "--task", "mlm", "--data", str(text)], expect="accept"),
    ]
    return cases[:count]
