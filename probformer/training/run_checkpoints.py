"""A run's checkpoints: save, restore and the ``checkpoints/latest`` pointer.

    checkpoints/latest          the name of the newest complete checkpoint
    checkpoints/step-NNNNNNN/   a model checkpoint (``checkpoint.save``) plus
                                training.safetensors (AdamW moments, RNG state) and
                                training.json (counters, optimizer groups, log state)

Crash safety rests on one rule: **nothing that ``latest`` points to is ever removed
or changed**. A checkpoint is written completely under a temporary name, renamed to
its final name, the pointer is replaced by an atomic rename, and only then are older
checkpoints pruned. A SIGKILL at any instant leaves ``latest`` naming a complete
checkpoint (or no pointer at all, before the first one). A failed write (disk full,
permission denied) removes the temporary folder (and ``checkpoints/`` itself when this
save created it) and raises one ``WriteError`` naming the path; the pointer still names
the previous checkpoint.

A checkpoint is a model folder (``checkpoint.save``, the format of ``model/`` and of a
torch export) with the training state beside the model files: every model reader
(``probformer.from_pretrained``, ``probformer.load``, the CLI) takes it as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from probformer.models import registry
from probformer.models.folder_data import read_json
from probformer.models.pretrained import check_finite, latest_checkpoint_folder
from probformer.training import checkpoint, crash_points
from probformer.training.checkpoint import WriteError, write_failure

__all__ = [
    "latest_checkpoint",
    "save_training_checkpoint",
    "restore_training_checkpoint",
    "save_model_folder",
    "remove_stale_temporaries",
    "write_text_atomic",
    "read_record",
    "read_training_state",
    "WriteError",
]

NUMBER = (int, float)
# what a resume reads from a checkpoint's training.json, with its type: the counters and the
# optimiser groups it cannot go on without, and the log and early-stopping state when present
TRAINING_KEYS = {"step": int, "epoch": int, "batch_in_epoch": int, "tokens_seen": int, "elapsed": NUMBER}
TRAINING_KEYS |= {"param_groups": list}
TRAINING_OPTIONAL = {"tags": (list, type(None)), "early_stopping": dict, "metrics_lines": int}
TRAINING_OPTIONAL |= {"window_loss": NUMBER, "window_steps": int}
TYPE_NAMES = {int: "an integer", NUMBER: "a number", list: "a JSON list", dict: "a JSON object"}
TYPE_NAMES |= {(list, type(None)): "a JSON list or null"}


def latest_checkpoint(run_dir) -> Path:
    """The newest complete checkpoint of a run folder (via ``checkpoints/latest``, checked:
    ``pretrained.latest_checkpoint_folder``)."""
    path = latest_checkpoint_folder(Path(run_dir))
    if path is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({Path(run_dir) / 'checkpoints' / 'latest'} is missing)")
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise write_failure(path, error) from None


def read_record(path: Path, keys: dict, optional: dict | None = None) -> dict:
    """The JSON object in the run file ``path``, each of ``keys`` (and of ``optional``, when
    present) holding a value of its type; else ``ValueError`` naming the file and the key: a
    damaged or hand-edited file is said to be one, not met as a KeyError inside a resume."""
    record = read_json(path)  # bad JSON, an empty file: ValueError naming it
    if not isinstance(record, dict):
        raise ValueError(f"{path} must hold a JSON object with the keys {sorted(keys)}, got {type(record).__name__}")
    missing = sorted(set(keys) - set(record))
    if missing:
        raise ValueError(f"{path} lacks the key(s) {missing}; it must hold {sorted(keys)}: the file is damaged")
    for key, kind in {**keys, **{k: v for k, v in (optional or {}).items() if k in record}}.items():
        value = record[key]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise ValueError(f"{path}: {key!r} must be {TYPE_NAMES[kind]}, got {type(value).__name__} {value!r:.60}")
    return record


def read_training_state(checkpoint_folder: Path) -> dict:
    """A checkpoint's ``training.json``, checked (``read_record``)."""
    return read_record(Path(checkpoint_folder) / "training.json", TRAINING_KEYS, TRAINING_OPTIONAL)


def _pointed_name(folder: Path) -> str | None:
    pointer = folder / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(run_dir) -> None:
    """Remove what a killed process left half-written: ``.NAME.tmp-PID`` files and
    folders and ``.NAME.old-PID`` (``model``, ``best``) in the run folder and its ``checkpoints``.
    A swap killed between its two renames left ``NAME`` missing and its previous copy in
    ``.NAME.old-PID``: that copy is moved back first, so the folder is never lost."""
    run_dir = Path(run_dir)
    if run_dir.is_dir() and not run_dir.is_symlink():
        for old in sorted(run_dir.glob(".*.old-*")):
            final = run_dir / old.name[1:].rsplit(".old-", 1)[0]
            if old.is_dir() and not old.is_symlink() and not (final.exists() or final.is_symlink()):
                os.replace(old, final)
    for folder in (run_dir, run_dir / "checkpoints"):
        if folder.is_dir() and not folder.is_symlink():
            for stale in [*folder.glob(".*.tmp-*"), *folder.glob(".*.old-*")]:
                _remove(stale)


def _optimizer_state(optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """AdamW's state as flat tensors (for safetensors; nothing pickled) and its groups."""
    state = optimizer.state_dict()
    tensors = {
        f"optimizer.{index}.{key}": value.detach().contiguous().cpu()
        for index, slots in state["state"].items()
        for key, value in slots.items()
    }
    return tensors, state["param_groups"]


def _load_optimizer_state(optimizer, tensors: dict, groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for group in groups:
        group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_training_checkpoint(run_dir, step: int, model, optimizer, vocabulary, counters: dict) -> Path:
    """Write ``checkpoints/step-<step>`` (model, optimizer, RNG state, ``counters``), move
    ``latest`` to it and prune the older ones. Refuses (``FloatingPointError``, nothing
    written) a model with non-finite parameters, so ``latest`` always names good weights."""
    folder = Path(run_dir) / "checkpoints"
    if folder.is_symlink():  # its old checkpoints are pruned below: never in another folder
        raise ValueError(f"{folder} is a symlink; a run folder's checkpoints must be its own files")
    name = f"step-{step:07d}"
    final = folder / name
    if _pointed_name(folder) == name:
        # already the latest: the state after a given step is a function of the step
        # (exact resume), and what ``latest`` names is never replaced
        return final
    try:
        check_finite(registry.unique_state(model), f"parameters after step {step}", FloatingPointError)
    except FloatingPointError as error:
        previous = _pointed_name(folder)
        kept = f"{folder / previous} stays the last checkpoint" if previous else "no checkpoint was written yet"
        raise FloatingPointError(f"training stopped: {error}; nothing was saved and {kept}") from None
    temporary = folder / f".{name}.tmp-{os.getpid()}"
    created = not folder.exists()  # a failed first save removes it again: the run folder stays as it was
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _remove(temporary)
        checkpoint.save(model, temporary, vocabulary)
        crash_points.reached("save:weights")
        tensors, groups = _optimizer_state(optimizer)
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(temporary / "training.safetensors"))
        (temporary / "training.json").write_text(json.dumps({**counters, "param_groups": groups}))
        crash_points.reached("save:temporary")
        if final.exists():  # complete but never pointed to: a killed run's, safe to replace
            shutil.rmtree(final)
        os.replace(temporary, final)
    except (OSError, SafetensorError) as error:
        _remove(temporary)
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        raise write_failure(final, error) from None
    crash_points.reached("save:renamed")
    write_text_atomic(folder / "latest", name)
    crash_points.reached("save:pointer")
    for old in folder.iterdir():  # keep the newest complete checkpoint only
        if old.name not in (name, "latest"):
            _remove(old)
    return final


def restore_training_checkpoint(source: Path, model, optimizer) -> dict:
    """Load ``source`` (from ``latest_checkpoint``) into ``model`` and ``optimizer``, set
    the RNG state; the counters saved with it."""
    saved, _ = checkpoint.load(source)
    model.load_state_dict(saved.state_dict())
    counters = read_training_state(source)
    path = source / "training.safetensors"
    try:
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises its own errors on truncated or foreign files
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
    if "rng.torch" not in tensors:
        raise ValueError(f"{path} lacks the tensor 'rng.torch' (the RNG state a resume continues from): it is damaged")
    try:
        _load_optimizer_state(optimizer, tensors, counters["param_groups"])
        torch.set_rng_state(tensors["rng.torch"])
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as error:
        raise ValueError(
            f"{path} and the param_groups of {source / 'training.json'} do not restore this run's optimiser and "
            f"RNG state: {error}"
        ) from None
    return counters


def save_model_folder(run_dir, model, vocabulary, tags: list[str] | None, name: str = "model") -> Path:
    """Write the run's ``model/`` folder (or ``best/``: a plain checkpoint, plus ``tags.json``)
    under a temporary name, then swap it in: a reader never sees a half-written model."""
    run_dir = Path(run_dir)
    final = run_dir / name
    temporary, old = run_dir / f".{name}.tmp-{os.getpid()}", run_dir / f".{name}.old-{os.getpid()}"
    try:
        _remove(temporary)
        checkpoint.save(model, temporary, vocabulary)
        if tags:
            (temporary / "tags.json").write_text(json.dumps(tags))
        if final.exists():
            os.replace(final, old)
            crash_points.reached("swap:moved")
        os.replace(temporary, final)
    except (OSError, SafetensorError) as error:
        _remove(temporary)
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise write_failure(final, error) from None
    _remove(old)
    return final
