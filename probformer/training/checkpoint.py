"""Checkpoints: the one model folder (``probformer.models.pretrained``): ``config.json``
(format, model kind, config), ``model.safetensors`` (weights; never pickle) and optionally
``vocabulary.json`` (and ``tokenizer.json`` for a subword vocabulary). A run's ``model/``,
each checkpoint and a torch export are this folder, so ``probformer.from_pretrained``,
``probformer.load`` and every CLI verb read all of them; a training checkpoint keeps its
optimiser, step and RNG state beside the model files (``run_checkpoints``).

All files are written under temporary names and renamed into place only when every one
is written, so a killed process leaves either the old files or the new ones; a failed
write (disk full, permission denied) removes its temporary files and any folder the save
created, and raises one ``WriteError`` naming the path. ``load`` refuses weights that are
not finite, naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from probformer.models import pretrained, registry
from probformer.training.data import SubwordVocabulary, Vocabulary

__all__ = ["save", "load", "load_tags", "FORMAT", "WriteError", "write_failure"]

FORMAT = pretrained.TORCH_FORMAT  # one format with the torch export


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


def _write_failure(path, error: BaseException):
    return write_failure(path, error) if isinstance(error, OSError | SafetensorError) else None


def save(model, directory, vocabulary: Vocabulary | None = None) -> Path:
    """Write ``model`` (and its ``vocabulary``) into ``directory``, created if needed; all
    files or none (``WriteError`` naming the path, the parent left as it was)."""
    directory = Path(directory)
    try:
        kind = registry.kind_of(model)
    except ValueError:
        known = sorted(registry.KINDS)
        raise ValueError(f"cannot checkpoint a {type(model).__name__}; known models: {known}") from None
    meta = {"format": FORMAT, "model": kind, "config": model.config.to_dict()}
    weights = {k: v.detach().contiguous().cpu() for k, v in registry.unique_state(model).items()}
    writers = {
        # no safetensors metadata: its keys are written in an unspecified order, and a run's
        # checkpoints must be byte-identical when the weights are (exact resume is tested so)
        "model.safetensors": lambda p: save_file(weights, str(p)),
        "config.json": lambda p: p.write_text(json.dumps(meta, indent=1)),
    }
    if vocabulary is not None:
        writers["vocabulary.json"] = lambda p: p.write_text(json.dumps(vocabulary.words))
        if isinstance(vocabulary, SubwordVocabulary):
            writers["tokenizer.json"] = vocabulary.save
    return pretrained.write_folder(directory, writers, _write_failure)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def load(directory):
    """``(model, vocabulary or None)`` from a model folder (a checkpoint, a run's
    ``model/``, a torch export) or a training-run folder (its ``model/``, else its latest
    checkpoint), the model in training mode on the CPU; read by the one reader of the
    folder (``pretrained.load_files``), so a clear error for anything that is not one
    (missing files, foreign format, wrong shapes, non-finite weights)."""
    directory = pretrained.model_folder(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"not a probformer checkpoint: {directory / 'config.json'} is missing")
    try:
        model = pretrained.load_files(pretrained.folder_files(directory)).train()
    except OSError as error:  # unreadable: permissions, a file removed while loading
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"{directory}: cannot be read: {error}") from None
    vocabulary = None
    if (directory / "tokenizer.json").is_file():
        vocabulary = SubwordVocabulary.load(directory / "tokenizer.json")
    elif (directory / "vocabulary.json").is_file():
        vocabulary = Vocabulary(_read_json(directory / "vocabulary.json"))  # checked by load_files
    return model, vocabulary


def load_tags(path, num_classes: int) -> list[str] | None:
    """The tag names of a tagger's model folder, index -> tag: its ``tags.json`` (a run's
    ``model/``, a torch export), else the ``tags`` its ``training.json`` recorded (a
    checkpoint); ``path`` as ``load`` takes it. ``None`` when the folder records none.
    ``ValueError`` naming the file unless they are ``num_classes`` distinct strings: a
    list of another length would score each class under another tag's name."""
    folder = pretrained.model_folder(path)
    where = folder / "tags.json"
    if where.is_file():
        tags = pretrained.read_json(where)
    elif (folder / "training.json").is_file():
        where = folder / "training.json"
        record = pretrained.read_json(where)
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a checkpoint's training state is a JSON object, got {type(record).__name__}")
        tags = record.get("tags")
        if tags is None:
            return None
        where = f"{where} (its 'tags')"
    else:
        return None
    if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise ValueError(f"{where}: the tags are a JSON list of strings (index -> tag), got {str(tags)[:80]}")
    repeated = sorted({t for t in tags if tags.count(t) > 1})
    if repeated:
        raise ValueError(f"{where}: the tags {repeated[:5]} appear more than once; each names one class")
    if len(tags) != num_classes:
        raise ValueError(f"{where}: {len(tags)} tags, but the model has num_classes = {num_classes} outputs")
    return tags
