"""What ``probformer train --resume`` checks before it continues a run: the run folder and
the checkpoint to start from, the config against the one the run saved (only the keys in
``RESUMABLE_CHANGES`` may differ), and the data, which must encode as it did when the
checkpoint was written (the text's fingerprint decides whether a subword vocabulary is
reused)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from probformer.training import run_config
from probformer.training.data import text_lines
from probformer.training.run_checkpoints import latest_checkpoint, read_record, read_training_state
from probformer.training.run_config import RunConfig

__all__ = ["RESUMABLE_CHANGES", "resume_source", "check_same_encoding", "text_fingerprint", "saved_fingerprint"]

# train.* keys a resume may change
RESUMABLE_CHANGES = {"steps", "epochs", "threads", "log_every", "eval_every", "checkpoint_every", "diagnostics_every"}
RESUMABLE_CHANGES |= {"device"}  # checkpoints are device-independent
RESUMABLE_CHANGES |= {"hold_freed_memory"}  # where freed memory goes changes no number


def resume_source(out: Path, config: RunConfig) -> Path | None:
    """The checkpoint to resume from, after checking the run folder and its config;
    ``None`` for a run killed before its first checkpoint (it starts again)."""
    if not out.is_dir():
        raise FileNotFoundError(f"--resume: {out} does not exist (nothing to resume)")
    saved = out / "run.json"
    if saved.is_file():
        _check_resumable(config, read_record(saved, {"model": dict, "data": dict, "train": dict}), out)
    elif any(not entry.name.startswith(".") for entry in out.iterdir()):
        raise FileNotFoundError(f"--resume: {out} is not a run folder ({saved} is missing)")
    if not (out / "checkpoints" / "latest").is_file():
        return None
    return latest_checkpoint(out)


def _check_resumable(config: RunConfig, saved: dict, out: Path) -> None:
    now = config.to_dict()
    try:  # a run.json from before a key existed: the key's default is what that run used
        tables = {table: saved[table] for table in ("model", "data", "train") if table in saved}
        if isinstance(tables.get("train"), dict):  # a CUDA run resumed where there is none
            tables["train"] = {k: v for k, v in tables["train"].items() if k != "device"}
        saved = run_config.RunConfig.from_dict(tables).to_dict()
    except ValueError:
        pass  # a key since removed or renamed: compared as written (and so reported as changed)
    changed = [
        f"{table}.{key}"
        for table in ("model", "data", "train")
        for key in set(saved.get(table, {})) | set(now[table])
        if saved.get(table, {}).get(key) != now[table].get(key) and not (table == "train" and key in RESUMABLE_CHANGES)
    ]
    if changed:
        raise ValueError(f"--resume with a different config: {sorted(changed)} changed since {out / 'run.json'}")


def check_same_encoding(resume_from: Path, corpus, saved_vocabulary, source: str) -> None:
    """The data must encode exactly as it did for the checkpoint: the same words and tags."""
    saved_tags = read_training_state(resume_from).get("tags")
    if list(corpus.vocabulary.words) != list(saved_vocabulary.words) or corpus.tags != saved_tags:
        raise ValueError(
            f"vocabulary mismatch between checkpoint {resume_from} ({len(saved_vocabulary)} words, "
            f"tags {saved_tags}) and data.source {source!r} ({len(corpus.vocabulary)} "
            f"words, tags {corpus.tags})"
        )


def text_fingerprint(source: str) -> str | None:
    """SHA-256 of a text source's lines (``None`` for the built-in corpora): a resumed run
    reuses its saved subword vocabulary only on the same text."""
    if source in ("ptb", "ewt"):
        return None
    return hashlib.sha256("\n".join(text_lines(source)).encode("utf-8")).hexdigest()


def saved_fingerprint(out: Path) -> str | None:
    try:
        return json.loads((out / "run.json").read_text()).get("data_sha256")
    except (OSError, ValueError, AttributeError):
        return None
