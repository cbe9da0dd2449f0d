"""``save_pretrained`` / ``from_pretrained``: a model as a folder of ``config.json`` and
``model.safetensors`` (the Hugging Face layout), read with the checks of ``probformer.load``.

    save_pretrained(model, folder)        any model kind -> the folder
    from_pretrained(folder)               the trainable model (eval mode), its kind read from config.json
    Model.from_pretrained(folder)         the same, refusing a folder that holds another kind
    model.save_pretrained(folder)         (``PretrainedMixin``: every model class inherits it)

The folder is one format with ``probformer.export(model, path, format="torch")``, which
calls ``save_pretrained`` and adds the vocabulary; ``load_files`` is the one reader of it
(``probformer.load`` wraps what it returns in ``registry.LogitsOnly``). ``config.json`` is
the record ``{"format": "probformer-torch/2", "model": kind, "config": {...}}``: the kind
picks the class (``registry.KINDS``), the config is checked by its config class, and the
weights against a model built from it, before anything is allocated at full size. Nothing
in the folder is ever run: weights come from safetensors, never from pickle, and any file
other than config.json, model.safetensors, vocabulary.json and tokenizer.json is refused,
except a training checkpoint's state beside the model (training.json, training.safetensors)
and a tagger's tag names (tags.json): data, never read here. vocabulary.json and tokenizer.json
are checked against the model and each other (``folder_data.check_vocabulary``).

One model folder: a training run's ``model/``, each of its checkpoints and a torch export
are this folder (``probformer-checkpoint/1``, what runs wrote before, reads the same way),
and ``model_folder`` turns a run folder into its model, so every reader takes all of them.
Why a mixin of our own and not huggingface_hub's: docs/models.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from probformer.models import registry
from probformer.models.blocks import non_finite
from probformer.models.declared import check_declared, undeclared_factors
from probformer.models.folder_data import LIMITS, check_vocabulary, read_bytes, read_json

__all__ = ["PretrainedMixin", "save_pretrained", "from_pretrained", "load_files", "folder_files", "model_folder"]
__all__ += ["write_folder", "TORCH_FORMAT", "FOLDER_FORMATS", "latest_checkpoint_folder"]
__all__ += ["read_bytes", "read_json", "LIMITS"]  # folder_data's, shared with probformer.load

TORCH_FORMAT = "probformer-torch/2"
# the record a model folder may carry: the torch export's, and the one training runs wrote before
FOLDER_FORMATS = (TORCH_FORMAT, "probformer-checkpoint/1")
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
FOLDER_FILES = (CONFIG_NAME, WEIGHTS_NAME, "vocabulary.json", "tokenizer.json")
# a training checkpoint's state and a tagger's tag names, kept beside the model files; data that no
# model reader opens
TRAINING_FILES = ("training.json", "training.safetensors", "tags.json")
# "owner/name": what from_pretrained looks up on the Hugging Face hub when no such folder exists
HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class PretrainedMixin:
    """``model.save_pretrained(folder)`` and ``Model.from_pretrained(folder_or_repo)``,
    named and called as huggingface_hub's ``ModelHubMixin``; both are this module's
    functions, so every kind is saved and read by one implementation."""

    def save_pretrained(self, save_directory) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``save_directory``."""
        return save_pretrained(self, save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **options) -> nn.Module:
        """The model saved in a folder (or a hub repo ``owner/name``); ``ValueError`` if the
        folder holds another kind. ``options``: those of ``from_pretrained``."""
        return from_pretrained(pretrained_model_name_or_path, kind=registry.kind_of(cls), **options)


# ---- reading files, shared with probformer.load --------------------------------------------


def check_record(meta, expected_format: str | tuple[str, ...], where, extra_keys=()) -> None:
    """A ``{"format", "model", "config"}`` record (plus ``extra_keys``, which the caller
    checks): the format (or one of the formats), a known kind and a config object."""
    keys = {"format", "model", "config"} | set(extra_keys)
    if not isinstance(meta, dict) or not {"format", "model", "config"} <= set(meta) <= keys:
        found = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{where}: the probformer record must have keys {sorted(keys)}; got {found}")
    formats = (expected_format,) if isinstance(expected_format, str) else tuple(expected_format)
    if meta["format"] not in formats:
        wanted = repr(formats[0]) if len(formats) == 1 else f"one of {list(formats)}"
        raise ValueError(f"{where}: format must be {wanted}, got {meta['format']!r}")
    if not isinstance(meta["model"], str) or meta["model"] not in registry.KINDS:
        raise ValueError(f"{where}: unknown model kind {meta['model']!r}; known: {sorted(registry.KINDS)}")
    if not isinstance(meta["config"], dict):
        raise ValueError(f"{where}: config must be a JSON object, got {type(meta['config']).__name__}")


def build_model(meta: dict, where, device: str = "meta") -> nn.Module:
    """A fresh eval-mode model from a checked record, every config value checked by its
    config class. On the meta device by default: shapes, dtypes and shared tensors
    without allocating."""
    try:
        with torch.device(device):
            return registry.build(meta["model"], meta["config"]).eval()
    except ImportError as error:  # a module the model's code needs, not the config: said as it is
        module = error.name or str(error)
        raise ImportError(
            f"{where}: building the {meta['model']!r} model needs the module {module!r}, which cannot be "
            f"imported: {error}",
            name=error.name,
        ) from error
    except Exception as error:  # the config classes raise ValueError/TypeError naming the key
        raise ValueError(f"{where}: bad model config: {error}") from None


def check_finite(tensors: dict, where, error: type[Exception] = ValueError) -> None:
    """``error`` naming the first floating tensor of ``tensors`` that holds a NaN or an
    infinity (one host read for all of them): a ``ValueError`` for what is read or saved, a
    ``FloatingPointError`` for the weights a training step made."""
    bad = non_finite(tensors)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise error(f"{where}: tensor {bad[0]!r}{more} holds NaN or infinite values")


def least_bytes(model: nn.Module) -> int:
    """The fewest bytes that can hold ``model``'s tensors (each shared tensor once, floats
    in 16 bits): a file smaller than this cannot be its weights."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    return sum(
        t.numel() * (min(t.element_size(), 2) if t.dtype.is_floating_point else t.element_size()) for t in unique
    )


# ---- saving --------------------------------------------------------------------------------


def save_pretrained(model: nn.Module, save_directory) -> Path:
    """Write ``model`` (any kind; unwrapped from DDP or ``torch.compile``) into
    ``save_directory`` as ``config.json`` and ``model.safetensors`` (each shared tensor
    once, in the model's dtype); returns the folder. The folder is created if needed;
    one that holds other files, and a model with NaN or infinite weights, are refused
    (``from_pretrained`` would refuse what that wrote)."""
    kind = registry.kind_of(model)  # ValueError for a foreign module
    model = getattr(model, "module", getattr(model, "_orig_mod", model))
    check_declared(model)
    if undeclared_factors(model):
        raise ValueError(
            f"cannot save the factor(s) {', '.join(undeclared_factors(model))}: they are not the config's "
            f"(pairwise={model.config.pairwise!r}), and a saved model stores the config and weights, never code; "
            "export it traced (probformer.deploy.export, format 'onnx' or 'exported')"
        )
    weights = {name: t.detach().contiguous().cpu() for name, t in registry.unique_state(model).items()}
    check_finite(weights, f"cannot save the {kind}")
    folder = Path(save_directory)
    present = [entry.name for entry in os.scandir(folder)] if folder.is_dir() else []
    other = sorted(name for name in present if name not in (CONFIG_NAME, WEIGHTS_NAME))
    if other:
        raise FileExistsError(
            f"{folder} holds {other[:5]}: a saved model's folder holds only {CONFIG_NAME} and {WEIGHTS_NAME} "
            "(from_pretrained refuses anything else); choose another folder or remove them"
        )
    from safetensors.torch import save_file

    record = {"format": TORCH_FORMAT, "model": kind, "config": model.config.to_dict()}
    metadata = {"format": TORCH_FORMAT, "model": kind}
    return write_folder(
        folder,
        {
            WEIGHTS_NAME: lambda p: save_file(weights, str(p), metadata=metadata),
            CONFIG_NAME: lambda p: p.write_text(json.dumps(record, indent=1)),
        },
    )


def write_folder(folder, writers: dict[str, Callable[[Path], None]], failure=None) -> Path:
    """Write the files ``writers`` names (``{name: write(path)}``) into ``folder``, all or
    nothing: each is written under a temporary name first, and only when all are written
    are they renamed into place, so an interrupted save never leaves a half-written file
    or a mix of old and new ones. A failure removes the temporaries and every folder this
    call created, leaving the parent exactly as it was; ``failure(path, error)`` gives
    the exception to raise for an error while writing ``path`` (None: the error itself)."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    staged: list[tuple[Path, Path]] = []
    current = folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, write in writers.items():
            current = folder / name
            staged.append((folder / f".{name}.tmp-{os.getpid()}", current))
            write(staged[-1][0])
        for temporary, final in staged:
            current = final
            os.replace(temporary, final)
    except BaseException as error:
        for temporary, _ in staged:
            temporary.unlink(missing_ok=True)
        if created:  # the top-most folder this call made holds nothing of anyone else's
            shutil.rmtree(created[-1], ignore_errors=True)
        replacement = failure(current, error) if failure is not None and isinstance(error, Exception) else None
        if replacement is None:
            raise
        raise replacement from None
    return folder


# ---- loading -------------------------------------------------------------------------------


def model_folder(path) -> Path:
    """The model folder that ``path`` names: ``path`` itself when it holds a config.json,
    else a training run's ``model/`` folder, else the run's latest checkpoint (named by
    ``checkpoints/latest``, for a run stopped before its end). ``FileNotFoundError`` when
    ``path`` is none of them."""
    path = Path(path)
    if not path.is_dir() or (path / CONFIG_NAME).exists():
        return path
    if (path / "model").is_symlink():  # a run folder's model is its own: a link would read elsewhere
        raise ValueError(f"{path / 'model'} is a symlink; a run folder's model/ must be a folder in it")
    if (path / "model" / CONFIG_NAME).is_file():
        return path / "model"
    checkpoint = latest_checkpoint_folder(path)
    if checkpoint is not None:
        return checkpoint
    if (path / "run.json").is_file():
        raise FileNotFoundError(f"{path} is a training-run folder with no model yet (no model/, no checkpoint)")
    return path  # read as a model folder: its own errors name what is missing


def latest_checkpoint_folder(run: Path) -> Path | None:
    """The checkpoint that ``run/checkpoints/latest`` names, or None without that pointer.
    It must be one name ``step-N`` of a folder in the run's own ``checkpoints/``, with no
    symlink on the way: a crafted pointer (an absolute path, ``../..``) or link would make
    every reader load, and a resumed run prune, files outside the run."""
    folder = Path(run) / "checkpoints"
    pointer = folder / "latest"
    if not (pointer.is_file() or pointer.is_symlink()):
        return None
    for link in (folder, pointer):
        if link.is_symlink():
            raise ValueError(f"{link} is a symlink; a run folder's checkpoints must be its own files")
    name = pointer.read_text().strip()
    if not _CHECKPOINT_NAME.match(name):
        raise ValueError(f"{pointer} must name a checkpoint folder step-N beside it, got {name[:40]!r}")
    checkpoint = folder / name
    if checkpoint.is_symlink():
        raise ValueError(f"{checkpoint} is a symlink; a run folder's checkpoints must be its own files")
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{pointer} names {name}, which does not exist")
    return checkpoint


_CHECKPOINT_NAME = re.compile(r"^step-[0-9]+$")


def folder_files(folder: Path) -> dict[str, Path]:
    """The folder's model files, refusing symlinks, subfolders and any name not in
    FOLDER_FILES or TRAINING_FILES (a .py, .pkl, .bin or .pt beside the weights is refused,
    not ignored); the training files are allowed and left out of what it returns."""
    files = {}
    allowed = FOLDER_FILES + TRAINING_FILES
    for entry in os.scandir(folder):
        if entry.is_symlink():
            raise ValueError(f"{folder}: {entry.name!r} is a symlink; a model folder holds regular files only")
        if entry.name not in allowed or not entry.is_file(follow_symlinks=False):
            raise ValueError(f"{folder}: unexpected {entry.name!r}; a model folder holds only {list(allowed)}")
        if entry.name in FOLDER_FILES:
            files[entry.name] = Path(entry.path)
    for required in (CONFIG_NAME, WEIGHTS_NAME):
        if required not in files:
            raise FileNotFoundError(f"not a saved probformer model: {folder / required} is missing")
    return files


def load_files(files: dict[str, Path], kind: str | None = None) -> nn.Module:
    """The model stored in ``files`` (``{"config.json": path, "model.safetensors": path,
    optional "vocabulary.json", "tokenizer.json"}``), in eval mode on the CPU, every check
    of the module docstring made; ``kind``: refuse any other kind."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path, where = files[CONFIG_NAME], files[WEIGHTS_NAME]
    meta = read_json(config_path)
    check_record(meta, FOLDER_FORMATS, config_path)
    if kind is not None and meta["model"] != kind:
        raise ValueError(
            f"{config_path}: holds a {meta['model']!r} model, not a {kind!r}; "
            "probformer.models.pretrained.from_pretrained reads any kind"
        )
    needed = least_bytes(build_model(meta, config_path))
    if needed > where.stat().st_size:  # refused before the model is allocated
        raise ValueError(f"{config_path}: the config needs at least {needed} bytes of weights, {where} has fewer")
    model = build_model(meta, config_path, device="cpu")
    try:
        if where.stat().st_size > LIMITS["safetensors"]:
            raise ValueError(f"{where}: larger than {LIMITS['safetensors']} bytes")
        weights = load_file(str(where))  # memory-mapped
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"{where} is not a readable safetensors file: {error}") from None
    dtype = registry.check_weights({k: (v.dtype, tuple(v.shape)) for k, v in weights.items()}, model, where, True)
    check_finite(weights, where)
    if dtype is not None:
        model.to(dtype)  # a model saved in bf16 loads in bf16
    expected = model.state_dict(keep_vars=True)
    by_tensor = {id(expected[name]): tensor for name, tensor in weights.items()}
    model.load_state_dict({name: by_tensor[id(t)] for name, t in expected.items()})  # aliases take their twin
    check_vocabulary(files, model.config.vocab_size)
    return model


def from_pretrained(
    pretrained_model_name_or_path,
    kind: str | None = None,
    *,
    map_location="cpu",
    revision: str | None = None,
    cache_dir=None,
    local_files_only: bool = False,
    token=None,
) -> nn.Module:
    """The model that ``save_pretrained`` (or ``probformer.export(..., format="torch")``,
    or a training run) wrote, as its trainable class in eval mode on ``map_location``. The
    argument is a model folder, a checkpoint folder or a training-run folder (its
    ``model/``, else its latest checkpoint: ``model_folder``). If no such path exists and
    it reads ``owner/name``, the hub repo's four allowed files are fetched with
    ``huggingface_hub`` (``revision``, ``cache_dir``, ``local_files_only``, ``token`` as
    there) and read the same way. ``kind``: refuse a folder holding another kind.
    ``ValueError`` for anything that is not exactly what probformer writes,
    ``FileNotFoundError`` when nothing is there."""
    map_location = _device(map_location)
    if not isinstance(local_files_only, bool):
        raise TypeError(f"local_files_only must be True or False, got {local_files_only!r}")
    path = Path(pretrained_model_name_or_path)
    try:
        if path.is_dir():
            files = folder_files(model_folder(path))
        elif path.exists():
            raise ValueError(f"{path} is a file; from_pretrained takes the folder that save_pretrained wrote")
        elif HUB_REPO.fullmatch(str(pretrained_model_name_or_path)) and not path.parent.is_dir():
            # "owner/name" with no local folder "owner": a hub repo (a missing "runs/x" stays local)
            hub = {"revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only, "token": token}
            files = _hub_files(str(pretrained_model_name_or_path), hub)
        else:
            raise FileNotFoundError(f"no saved model at {path}")
        return load_files(files, kind).to(map_location)
    except FileNotFoundError:
        raise
    except OSError as error:  # unreadable: permissions, a file removed while loading
        raise ValueError(f"{path}: cannot be read: {error}") from None


def _device(map_location) -> torch.device:
    """``map_location`` as a device this machine has, checked before any file is read (the
    model's ``.to`` failed with torch's words after the whole folder was)."""
    allowed = "None (the CPU), a device name ('cpu', 'cuda', 'cuda:1'), a CUDA device number or a torch.device"
    if map_location is None:  # as torch.load: where the files were read, the CPU
        return torch.device("cpu")
    if isinstance(map_location, bool) or not isinstance(map_location, str | int | torch.device):
        raise TypeError(f"map_location must be {allowed}, got {type(map_location).__name__} {map_location!r}")
    try:
        device = torch.device(map_location)
    except RuntimeError:
        raise ValueError(f"map_location must be {allowed}, got {map_location!r}") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"map_location {map_location!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def _hub_files(repo_id: str, options: dict) -> dict[str, Path]:
    """The repo's allowed files from the hub cache (downloaded unless ``local_files_only``),
    each resolved to its real file: the cache's snapshot folder is made of symlinks."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError:
        raise FileNotFoundError(
            f"no folder {repo_id!r}; reading a hub repo needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    files = {}
    for name in FOLDER_FILES:
        try:
            files[name] = Path(huggingface_hub.hf_hub_download(repo_id, name, **options)).resolve(strict=True)
        except EntryNotFoundError as error:  # not in the cache (offline) or not in the repo
            if name in (CONFIG_NAME, WEIGHTS_NAME):
                raise FileNotFoundError(f"no folder {repo_id!r}, and the hub repo has no {name}: {error}") from None
        except Exception as error:  # unknown repo, no access: huggingface_hub's own error types
            raise FileNotFoundError(f"no folder {repo_id!r}, and the hub repo cannot be read: {error}") from None
    return files
