"""Checkpoints: a directory with ``config.json`` (format, model kind, config),
``model.safetensors`` (weights; never pickle) and optionally ``vocabulary.json`` (and
``tokenizer.json`` for a subword vocabulary).

Every file is written to a temporary name and renamed into place, so a killed
process leaves either the old file or the new one; a failed write (disk full,
permission denied) removes its temporary file and raises one ``WriteError`` naming
the path. ``load`` refuses weights that are not finite, naming the tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from probformer.models import registry
from probformer.models.blocks import non_finite
from probformer.training.data import SubwordVocabulary, Vocabulary

__all__ = ["save", "load", "FORMAT", "WriteError", "write_failure", "check_finite"]

FORMAT = "probformer-checkpoint/1"


class WriteError(OSError):
    """A file of a checkpoint or run folder could not be written (disk full, permission
    denied, ...): the message names the path and the reason; ``errno``, ``filename``
    (the file that failed) and ``reason`` as the OS gave them."""

    def __init__(self, message: str, errno: int | None = None, filename=None, reason: str = ""):
        super().__init__(message)
        self.message, self.errno, self.filename, self.reason = message, errno, filename, reason

    def __str__(self) -> str:
        return self.message


def write_failure(path, error: BaseException) -> WriteError:
    """One clear ``WriteError`` for ``error`` (an ``OSError``, a ``SafetensorError``, which
    carries the OS error in its text, or a ``WriteError`` from a file inside ``path``)
    raised while writing ``path``."""
    if isinstance(error, WriteError):
        reason, culprit = error.reason, error.filename
    else:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        culprit = getattr(error, "filename", None)
    where = f" (at {culprit})" if culprit and str(culprit) != str(path) else ""
    return WriteError(f"cannot write {path}: {reason}{where}", getattr(error, "errno", None), culprit, reason)


def check_finite(tensors: dict, where) -> None:
    """``FloatingPointError`` naming the first floating tensor of ``tensors`` that holds a
    NaN or an infinity (one host read for all of them)."""
    bad = non_finite(tensors)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FloatingPointError(f"{where}: tensor {bad[0]!r}{more} holds non-finite values (NaN or infinity)")


def _atomic_write(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except (OSError, SafetensorError) as error:
        temporary.unlink(missing_ok=True)
        raise write_failure(path, error) from None


def save(model, directory, vocabulary: Vocabulary | None = None) -> Path:
    directory = Path(directory)
    try:
        kind = registry.kind_of(model)
    except ValueError:
        known = sorted(registry.KINDS)
        raise ValueError(f"cannot checkpoint a {type(model).__name__}; known models: {known}") from None
    meta = {"format": FORMAT, "model": kind, "config": model.config.to_dict()}
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise write_failure(directory, error) from None
    weights = {k: v.detach().contiguous().cpu() for k, v in registry.unique_state(model).items()}
    _atomic_write(directory / "model.safetensors", lambda p: save_file(weights, str(p)))
    _atomic_write(directory / "config.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
    if vocabulary is not None:
        _atomic_write(directory / "vocabulary.json", lambda p: p.write_text(json.dumps(vocabulary.words)))
        if isinstance(vocabulary, SubwordVocabulary):
            _atomic_write(directory / "tokenizer.json", vocabulary.save)
    return directory


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def load(directory):
    """``(model, vocabulary or None)`` from a checkpoint directory; a clear error for
    anything that is not one (missing files, foreign format, wrong shapes, non-finite
    weights)."""
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"not a probformer checkpoint: {path} is missing")
    meta = _read_json(config_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{config_path}: format must be {FORMAT!r}, got {meta.get('format') if isinstance(meta, dict) else meta!r}"
        )
    if meta.get("model") not in registry.KINDS:
        raise ValueError(f"{config_path}: unknown model {meta.get('model')!r}; known: {sorted(registry.KINDS)}")
    model = registry.build(meta["model"], meta.get("config", {}), section="config")
    try:
        weights = load_file(str(weights_path))
    except Exception as error:  # safetensors raises its own errors on truncated or foreign files
        raise ValueError(f"{weights_path} is not a readable safetensors file: {error}") from None
    registry.check_weights({k: (v.dtype, tuple(v.shape)) for k, v in weights.items()}, model, weights_path, True)
    try:
        check_finite(weights, weights_path)
    except FloatingPointError as error:
        raise ValueError(f"{error}; refusing to load it") from None
    model.load_state_dict(weights, strict=False)  # aliases of the saved tensors fill themselves
    vocabulary = None
    if (directory / "tokenizer.json").is_file():
        vocabulary = SubwordVocabulary.load(directory / "tokenizer.json")
    elif (directory / "vocabulary.json").is_file():
        words = _read_json(directory / "vocabulary.json")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"{directory / 'vocabulary.json'}: a vocabulary is a JSON list of strings")
        vocabulary = Vocabulary(words)
        if len(vocabulary) != model.config.vocab_size:
            raise ValueError(
                f"vocabulary has {len(vocabulary)} words but the model's vocab_size is {model.config.vocab_size}"
            )
    return model, vocabulary
