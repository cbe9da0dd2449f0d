"""Checkpoint folders a user hands to probformer: ``checkpoint.load`` of damaged and
crafted copies of one saved checkpoint per model kind (an accepted one must give finite
parameters and logits) and of paths that are not checkpoints, and ``checkpoint.save`` on a
full disk, which must end in one clear error leaving nothing half-written, or succeed
completely."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import (
    KINDS,
    VOCAB,
    forward,
    logits_of,
    tiny_model,
    unrelated_file,
)
from benchmarks.reliability.folder_damage import damage_folder
from benchmarks.reliability.harness import Case, nonfinite


def make_checkpoint_templates(workdir: Path) -> dict[str, Path]:
    """One saved checkpoint per model kind (with a vocabulary), written by the parent."""
    from probformer.training import checkpoint
    from probformer.training.data import Vocabulary

    folders = {}
    for kind in KINDS:
        folder = workdir / "templates" / f"checkpoint-{kind}"
        vocabulary = Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(VOCAB - 3)])
        checkpoint.save(tiny_model(kind), folder, vocabulary=vocabulary)
        folders[kind] = folder
    return folders


def loaded_check(output):
    """An accepted damaged file must at least give finite parameters and logits."""
    model = output[0] if isinstance(output, tuple) else output
    for name, tensor in getattr(model, "state_dict", dict)().items():
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            return "silent NaN", f"loaded a non-finite parameter {name}"
    logits = logits_of(forward(model, torch.tensor([[4, 5, 6]]), torch.ones(1, 3, dtype=torch.bool)))
    found = nonfinite(logits)
    return ("silent NaN", f"logits of a loaded model: {found}") if found else None


def checkpoint_cases(rng, count: int, workdir: Path) -> list[Case]:
    from probformer.training import checkpoint

    templates = make_checkpoint_templates(workdir)
    cases = []
    for number in range(count):
        kind = rng.choice(sorted(templates))
        copy = workdir / "checkpoints" / f"case-{number}"
        marker = str(workdir / "markers" / f"checkpoint-{number}")
        label, apply, expect, names = damage_folder(rng, templates[kind], "model.safetensors", marker)

        def run(kind=kind, copy=copy, apply=apply):
            shutil.copytree(templates[kind], copy, symlinks=True)
            apply(copy)
            return checkpoint.load(copy)

        cases.append(
            Case(
                "probformer.training.checkpoint.load",
                f"{kind}: {label}",
                run,
                expect=expect,
                names=names + (str(copy),),
                check=loaded_check,
                marker=marker,
                finite=False,
                accepted="silent NaN" if "nan" in label.lower() or "inf" in label else "silent wrong",
            )
        )
    for special, run in [
        ("a path that does not exist", lambda: checkpoint.load(workdir / "nowhere")),
        ("a file, not a folder", lambda: checkpoint.load(unrelated_file(workdir))),
        ("an empty folder", lambda: checkpoint.load(Path(tempfile.mkdtemp(dir=workdir)))),
    ]:
        cases.append(
            Case(
                "probformer.training.checkpoint.load",
                special,
                run,
                names=("nowhere", "unrelated.txt", "config.json", "checkpoint", str(workdir)),
            )
        )
    return cases


class LeftBehind(Exception):
    """A failed write left a temporary or half-written file behind."""


def save_cases(rng, count: int, workdir: Path) -> list[Case]:
    """checkpoint.save on a full disk: RLIMIT_FSIZE stops every write beyond a few bytes
    (each write then fails with EFBIG, as on a full disk); the save must end in one clear
    error naming the path and leave nothing half-written, or succeed completely."""
    import resource

    from probformer.training import checkpoint
    from probformer.training.data import Vocabulary

    vocabulary = Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(VOCAB - 3)])
    cases = []
    for number in range(count):
        kind = rng.choice(sorted(KINDS))
        limit = rng.choice([0, 1, 100, 1000, 5000, 20000, 10**6])
        existing = rng.random() < 0.3  # saving over a previous checkpoint must keep it whole
        folder = workdir / "saves" / f"case-{number}"

        def run(kind=kind, limit=limit, folder=folder, existing=existing):
            if existing:
                checkpoint.save(tiny_model(kind, seed=1), folder, vocabulary=vocabulary)
            before = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            try:
                return checkpoint.save(tiny_model(kind), folder, vocabulary=vocabulary)
            except BaseException as error:
                after = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
                if after != before:
                    raise LeftBehind(f"{type(error).__name__}: {error}; files before {before}, after {after}") from None
                raise
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

        def check(path, kind=kind):
            model, _ = checkpoint.load(path)
            expected = tiny_model(kind).state_dict()
            for name, tensor in model.state_dict().items():
                if not torch.equal(tensor, expected[name]):
                    return "silent wrong", f"the saved {name} differs from the model's"
            return None

        label = f"{kind}, writes limited to {limit} bytes{', over an older checkpoint' if existing else ''}"
        cases.append(
            Case(
                "probformer.training.checkpoint.save",
                label,
                run,
                expect="either",
                names=(str(folder), folder.name, "model.safetensors", "config.json", "vocabulary.json"),
                check=check,
                finite=False,
            )
        )
    return cases
