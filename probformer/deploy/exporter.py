"""Export a trained model for deployment (docs/export.md).

    export(model, path, format="torch")     a folder: config.json (format, model kind,
                                            config) and model.safetensors, the folder
                                            model.save_pretrained writes; no code (plus
                                            the vocabulary and a tagger's tags.json)
    export(model, path, format="exported")  a torch.export ExportedProgram (.pt2) with a
                                            dynamic batch and sequence length
    export(model, path, format="onnx")      ONNX through torch's exporter

There is one forward per model. The torch folder stores the config and the weights, and
``load`` rebuilds the same model class (``probformer.models``) around them. The .pt2
and ONNX files are traces of that same model's forward (``registry.LogitsOnly``), in eval
mode. A traced graph must not depend on values, so two settings are fixed for the trace,
never restated: the PT runs its "naive" head kernel (the fused kernel picks tiles by
length and calls a CPU-only op), and FoldedContext is right-padded to ``max_length``
(it is causal, so padding changes no earlier output). ``export`` loads what it wrote,
runs it on an example batch and refuses to finish unless it matches the source model.
A PT's declared ``Pairwise`` factor (``PTConfig(pairwise=...)``) is data and goes in every
format; a user factor added to ``model.crf.factors`` is code: the torch folder refuses it
by name, the traced formats trace it (its messages by autograd), or name it when its own
code does not trace.
Loading is ``probformer.deploy.reader`` (nothing in a file is ever executed).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from probformer.deploy.reader import EXPORTED_FORMAT, ONNX_FORMAT, TORCH_FORMAT, load
from probformer.models import declared, pretrained, registry
from probformer.models.blocks import check_token_inputs

__all__ = ["export", "load", "traced_module", "FORMATS", "TOLERANCE"]

FORMATS = ("torch", "exported", "onnx")
TOLERANCE = 1e-5
TRACE_MAX_LENGTH = 512  # the longest input of a traced FoldedContext (it has no max_length)


def _refuse_untraceable(kind: str, model: nn.Module, format: str) -> None:
    """Options whose forward depends on values (so no fixed graph exists): refused by name
    for the traced formats; the torch folder runs the model itself and takes them all."""
    if kind != "probabilistic_transformer":
        return
    engine = model.mean_field
    options = {
        "halting='act' or 'exit' (the number of iterations depends on the tokens)": engine.halting != "none",
        "schedule='sequential' (one Python step per node)": engine.schedule == "sequential",
        "span=True (ONNX has no clamp to a tensor bound)": format == "onnx" and engine.span is not None,
        # the arc table would be a constant of the program that is no weight of the model, which the
        # .pt2 reader refuses (constants must be the model's own tensors)
        "a topology given as arcs (.pt2 keeps no arc table)": format == "exported" and model.crf.topology.n_max,
    }
    found = [name for name, used in options.items() if used]
    if found:
        raise ValueError(
            f"format {format!r} cannot hold a PT with {', '.join(found)}; "
            "export it with format='torch' (the model itself, every option)"
        )


def _refuse_undeclared_factors(undeclared: list[str], format: str) -> None:
    """The torch folder rebuilds the model from its config: a factor the config does not
    declare would be lost (and its weights refused on load), so it is refused by name."""
    if undeclared and format == "torch":
        raise ValueError(
            f"format 'torch' cannot hold a PT with the user factor(s) {', '.join(undeclared)}: the folder "
            "stores the config and weights, never code; export it traced (format='onnx' or 'exported'), "
            "or declare a built-in factor in its config (PTConfig(pairwise='chain()'))"
        )


def traced_module(model: nn.Module, max_length: int | None = None) -> tuple[nn.Module, dict]:
    """``(module, meta)``: the eval-mode ``LogitsOnly`` view of a copy of ``model`` that
    ``torch.export`` and ONNX trace, and the record stored beside it (format, kind,
    config, the longest input)."""
    kind = registry.kind_of(model)
    source = copy.deepcopy(getattr(model, "module", getattr(model, "_orig_mod", model))).eval()
    source.requires_grad_(False)
    pad_to = None
    limit = getattr(source.config, "max_length", None)
    if kind == "probabilistic_transformer":
        source.mean_field.kernel = "naive"  # a fixed graph; values equal the fused kernel's
        n_max = source.crf.topology.n_max  # a topology given as arcs covers sentences up to n_max
        limit = min(limit, n_max) if limit and n_max else (n_max or limit)
    if kind == "folded_context":
        limit = pad_to = max_length or TRACE_MAX_LENGTH
    elif max_length is not None:
        limit = min(max_length, limit) if limit else max_length
    meta = {"model": kind, "config": source.config.to_dict(), "max_length": limit}
    return registry.LogitsOnly(source, pad_to=pad_to).eval(), meta


# ---- export ------------------------------------------------------------------------


def _example(model, example) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch to check the artefact on: the caller's, or three padded rows."""
    config = model.config
    if example is None:
        limit = min(getattr(config, "max_length", None) or 9, 9)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (3, limit), generator=generator)
        lengths = torch.tensor([limit, max(1, limit - 3), 1])
        return tokens, torch.arange(limit)[None, :] < lengths[:, None]
    tokens, mask = example if isinstance(example, tuple | list) else (example, None)
    return check_token_inputs(tokens, mask, config.vocab_size, getattr(config, "max_length", None))


def export(
    model, path, format: str = "torch", example=None, vocabulary=None, tolerance: float = TOLERANCE, max_length=None
) -> Path:
    """Write ``model`` (a trainable model, or the path of a checkpoint or run folder) to
    ``path``; returns ``path``.

    ``example``: tokens ``[B, n]`` or ``(tokens, mask)`` to check the artefact on (default:
    three random rows, two of them padded). ``vocabulary`` (taken from the checkpoint when
    ``model`` is a path) is written next to a "torch" export as vocabulary.json (and
    tokenizer.json for a subword vocabulary), and so are a tagger's tag names (tags.json,
    from the model folder's tags.json or a checkpoint's training.json). ``max_length`` caps the traced formats'
    input length (FoldedContext: default 512). Raises if the artefact's logits differ from
    the source's by more than ``tolerance`` anywhere; a failed export leaves nothing at
    ``path``.
    """
    _check_options(format, max_length, tolerance, vocabulary)
    _check_outside_model_folders(Path(path))
    _check_replaceable(Path(path))
    model, vocabulary, tags, undeclared = _source_model(model, vocabulary, format)
    tokens, mask = _example(model, example)
    expected = _logits_in_eval_mode(model, tokens, mask)
    writers = {"torch": functools.partial(_write_folder, tags=tags), "exported": _write_exported, "onnx": _write_onnx}
    writer = writers[format]

    def write_and_check(target: Path) -> None:
        _write_traced(writer, target, model, vocabulary, max_length, format, undeclared)
        with torch.no_grad():
            found = load(target)(tokens, mask)
        error = (found.float() - expected.float()).abs().max().item()
        if not error <= tolerance:
            raise RuntimeError(f"the export differs from the source model by {error:.3g} > tolerance {tolerance:g}")

    path = Path(path)
    _replace(path, write_and_check)
    return path


def _check_options(format, max_length, tolerance, vocabulary) -> None:
    words = getattr(vocabulary, "words", None)
    if vocabulary is not None and (not isinstance(words, list) or not all(isinstance(w, str) for w in words)):
        raise TypeError(
            "vocabulary must be None or a Vocabulary or SubwordVocabulary (probformer.training.data: .words, a list "
            f"of strings), got {type(vocabulary).__name__}"
        )
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"max_length must be an integer >= 1, got {type(max_length).__name__} {max_length!r}")
        if max_length < 1:
            raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        raise TypeError(f"tolerance must be a finite number >= 0, got {type(tolerance).__name__} {tolerance!r}")
    if not 0 <= tolerance < float("inf"):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")


def _source_model(model, vocabulary, format: str) -> tuple[nn.Module, object, list[str] | None, list[str]]:
    """``(model, vocabulary, a tagger's tag names, its undeclared user factors)``: a model
    folder loaded, and the model checked exportable in ``format``."""
    tags = None
    if isinstance(model, str | Path):
        from probformer.training.checkpoint import load_tags
        from probformer.training.evaluate import load_any

        source = model
        model, stored = load_any(source)
        vocabulary = vocabulary or stored
        if (
            getattr(model.config, "task", None) == "tagging"
        ):  # the tag names the classes: evaluate --task pos reads them
            tags = load_tags(source, model.config.num_classes)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a probformer model or a checkpoint path, got {type(model).__name__}")
    kind = registry.kind_of(model)  # raises for a foreign module
    declared.check_declared(model)
    if format != "torch":
        _refuse_untraceable(kind, model, format)
    undeclared = declared.undeclared_factors(model)
    _refuse_undeclared_factors(undeclared, format)
    return model, vocabulary, tags, undeclared


def _logits_in_eval_mode(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        expected = model(tokens, mask)[0]
    model.train(was_training)
    return expected


def _write_traced(writer, target: Path, model, vocabulary, max_length, format: str, undeclared: list[str]) -> None:
    try:
        writer(target, model, vocabulary, max_length)
    except Exception as error:  # torch.export's and ONNX's errors have many types
        if not undeclared:
            raise
        # a user factor is traced with the model (its messages by autograd): its own code
        # may depend on the traced length or on values
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"format {format!r} could not trace the PT with the user factor(s) {', '.join(undeclared)}: {first}"
        ) from error


# what export writes into a torch folder: a folder holding anything else is not replaced
EXPORT_FILES = ("config.json", "model.safetensors", "vocabulary.json", "tokenizer.json", "tags.json")
# the earlier torch format also wrote its loader module beside the weights
EARLIER_EXPORT_FILES = {"probformer-torch/1": ("probformer_runtime.py",)}


def _not_an_export_folder(path: Path) -> str | None:
    """Why the folder ``path`` is not what a torch export writes, or ``None`` when it is.
    A run's ``model/`` and its checkpoints share the folder's format, so the record alone
    would let an export delete a checkpoint's training state; their weights' header names
    no format (an export's names the config's), which tells them apart even when the file
    names match."""
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        return "it holds no config.json"
    meta = json.loads((path / "config.json").read_text())
    if not isinstance(meta, dict) or meta.get("format") not in (TORCH_FORMAT, "probformer-torch/1"):
        return "its config.json is no probformer export record"
    allowed = EXPORT_FILES + EARLIER_EXPORT_FILES.get(meta["format"], ())
    other = sorted(
        entry.name
        for entry in os.scandir(path)
        if entry.name not in allowed or entry.is_symlink() or not entry.is_file(follow_symlinks=False)
    )
    if other:
        return f"it holds {other[:5]}, and an export folder holds only {list(EXPORT_FILES)}"
    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        header = weights.metadata() or {}
    if header.get("format") != meta["format"]:
        return "its weights were not written by export (a training run's model/ or checkpoint)"
    return None


def _not_an_export(path: Path) -> str | None:
    """Why ``path`` holds nothing ``export`` wrote (its record names a probformer format),
    or ``None`` when it does."""
    try:
        if path.is_dir():
            return _not_an_export_folder(path)
        small = path.stat().st_size < (4 << 30)
        if path.suffix in (".pt2", ".onnx") and small and b"probformer-" in path.read_bytes():
            return None
        return "it is no .pt2 or .onnx file that export wrote"
    except (OSError, ValueError, SafetensorError) as error:
        return f"it cannot be read as one ({error})"


def _check_replaceable(path: Path) -> None:
    """An export replaces an earlier export at ``path``, never anything else (a user's file
    or folder that happens to be there, a training run's model or checkpoint)."""
    why = "it is a symlink" if path.is_symlink() else _not_an_export(path) if path.exists() else None
    if why:
        raise FileExistsError(f"{path} exists and is not a probformer export ({why}); choose another path or remove it")


def _check_outside_model_folders(path: Path) -> None:
    """A model folder (a run's ``model/``, a checkpoint, a torch export) holds only its model
    files, and every reader refuses anything else in it: an export written inside one
    would leave that model unreadable, so it is refused before anything is written."""
    for folder in path.resolve().parents:
        try:
            record = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):  # no config.json, or not ours
            continue
        if isinstance(record, dict) and str(record.get("format", "")).startswith("probformer-"):
            raise ValueError(
                f"{path} lies inside the model folder {folder}, which may hold only its model files "
                "(every reader refuses anything else there); choose a path outside it"
            )


def _replace(path: Path, write) -> None:
    """Write into a temporary sibling, then move it into place: a failed export leaves
    nothing half-written at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        target = staging / path.name
        write(target)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        target.replace(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_folder(folder: Path, model, vocabulary, max_length, tags=None) -> None:
    pretrained.save_pretrained(model, folder)  # the same folder as model.save_pretrained, plus the vocabulary
    if vocabulary is not None:
        (folder / "vocabulary.json").write_text(json.dumps(vocabulary.words))
        if hasattr(vocabulary, "tokenizer"):
            vocabulary.save(folder / "tokenizer.json")
    if tags is not None:
        (folder / "tags.json").write_text(json.dumps(tags))


def _trace_inputs(module) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2, length 5, one padded row: sizes other than 0 and 1, so both stay dynamic."""
    tokens = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 3:] = False
    return tokens, mask


def _dynamic_shapes(limit: int | None):
    batch = torch.export.Dim("batch", min=1)
    length = torch.export.Dim("length", min=1, max=limit) if limit else torch.export.Dim("length", min=1)
    return {"tokens": {0: batch, 1: length}, "mask": {0: batch, 1: length}}


def _write_exported(target: Path, model, vocabulary, max_length) -> None:
    module, meta = traced_module(model, max_length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, _trace_inputs(module), dynamic_shapes=_dynamic_shapes(meta["max_length"]))
    extra = {"probformer.json": json.dumps({"format": EXPORTED_FORMAT, **meta})}
    torch.export.save(program, str(target), extra_files=extra)


def _write_onnx(target: Path, model, vocabulary, max_length) -> None:
    import onnx

    module, meta = traced_module(model, max_length)
    with warnings.catch_warnings():  # the exporter's notes on axis names
        warnings.simplefilter("ignore")
        _onnx_export(module, _trace_inputs(module), _dynamic_shapes(meta["max_length"]), target)
    proto = onnx.load(str(target))
    onnx.helper.set_model_props(proto, {"probformer": json.dumps({"format": ONNX_FORMAT, **meta})})
    onnx.save(proto, str(target))


def _onnx_export(module, inputs, dynamic_shapes, target: Path) -> None:
    # the exporter prints progress to stdout and logs that torchvision ops are absent
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            torch.onnx.export(
                module,
                inputs,
                str(target),
                input_names=["tokens", "mask"],
                output_names=["logits"],
                dynamic_shapes=dynamic_shapes,
                external_data=False,  # one self-contained file (weights < 2 GB)
                dynamo=True,
                verbose=False,
            )
    finally:
        registry_log.setLevel(level)
