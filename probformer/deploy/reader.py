"""Load what ``probformer.export`` wrote, trusting nothing in the file to be code.

    load(path)   a torch folder -> the model (``LogitsOnly``, eval, no grad), read by
                 ``probformer.models.pretrained`` (the folder ``save_pretrained`` writes,
                 which is also a training checkpoint and a run's ``model/``; a run
                 folder reads as its model)
                 a .pt2 file    -> ``CheckedProgram``: the ExportedProgram behind input checks
                 an .onnx file  -> ``CheckedOnnx``: an onnxruntime session behind input checks

Every format names its model kind and config; the config is checked by building a fresh
model through its config class, and the weights are checked against that model (names,
shapes, dtypes, finite values) before anything runs. Weights come from safetensors,
raw tensor bytes or ONNX initialisers, never from pickle. A .pt2 is accepted only in the
exact layout ``torch.export.save`` writes for our models (``probformer.deploy.archive``)
and torch reads a fresh archive re-packed from the checked entries, never the file
itself. docs/export.md, "Trust model", explains each check. Anything else raises
``ValueError`` (``FileNotFoundError`` for a missing path) naming the file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from probformer.deploy import archive
from probformer.models import pretrained, registry
from probformer.models.blocks import check_token_inputs
from probformer.models.pretrained import TORCH_FORMAT

__all__ = ["load", "CheckedProgram", "CheckedOnnx", "TORCH_FORMAT", "EXPORTED_FORMAT", "ONNX_FORMAT", "LIMITS"]

EXPORTED_FORMAT, ONNX_FORMAT = "probformer-exported/2", "probformer-onnx/2"
# bytes read at most, checked on the file's size before reading it (json, safetensors: the torch folder's)
LIMITS = {**pretrained.LIMITS, "pt2": 4 << 30, "onnx": 2 << 30}


def load(path):
    """The model exported at ``path`` (a torch folder, a .pt2 or an .onnx file), callable
    as ``model(tokens, mask) -> logits``; ``ValueError`` for anything that is not exactly
    what probformer writes, ``FileNotFoundError`` when nothing is there."""
    path = Path(path)
    try:
        if path.is_dir():  # the one model folder (an export, a checkpoint, a run's model): its one reader
            model = pretrained.load_files(pretrained.folder_files(pretrained.model_folder(path)))
            return registry.LogitsOnly(model).eval().requires_grad_(False)
        if not path.is_file():
            raise FileNotFoundError(f"no exported model at {path}")
        with path.open("rb") as file:
            magic = file.read(4)
        if magic == b"PK\x03\x04":
            return _load_exported(path)
        if path.suffix != ".onnx":
            raise ValueError(f"{path}: neither a folder, a .pt2 (zip) archive nor an .onnx file")
        return _load_onnx(path)
    except FileNotFoundError:
        raise
    except OSError as error:  # unreadable: permissions, a file removed while loading
        raise ValueError(f"{path}: cannot be read: {error}") from None


# ---- shared checks (probformer.models.pretrained's, which the torch folder uses) ---------


def _read_bytes(path: Path, limit_name: str) -> bytes:
    return pretrained.read_bytes(path, LIMITS[limit_name], limit_name)


def _model_of(meta, expected_format: str, where, device: str = "meta"):
    """A freshly built model from a ``{"format", "model", "config", "max_length"}`` record
    of a traced format (``max_length``: the longest input the graph was traced for, or
    null): the format, the kind and every config value checked."""
    pretrained.check_record(meta, expected_format, where, extra_keys={"max_length"})
    limit = meta.get("max_length")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{where}: max_length must be null or an integer >= 1, got {limit!r}")
    return pretrained.build_model(meta, where, device)


# ---- .pt2 ---------------------------------------------------------------------------------


class CheckedProgram:
    """A graph called like the torch model, ``(tokens, mask) -> logits``, after the input
    checks the graph cannot make (integer ids ``[B, n]``, a bool mask of the same shape,
    ids in ``[0, vocab_size)``, a real token per row, n <= max_length)."""

    def __init__(self, run, config: dict, where, max_length: int | None = None):
        self.run, self.config, self.where = run, config, str(where)
        self.max_length = max_length or config.get("max_length")

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        tokens, mask = check_token_inputs(tokens, mask, self.config["vocab_size"], self.max_length)
        return self.run(tokens, mask)


def _load_exported(path: Path) -> CheckedProgram:
    contents = archive.read_pt2(_read_bytes(path, "pt2"), path)
    model = _model_of(contents.meta, EXPORTED_FORMAT, f"{path} (probformer.json)")
    view = registry.LogitsOnly(model)
    found = {fqn: (getattr(torch, p.dtype), p.shape) for fqn, p in contents.weights.items()}
    registry.check_weights(found, view, path, aliases_once=False)
    buffers = dict(view.named_buffers())
    for fqn, payload in {**contents.weights, **contents.constants}.items():
        tensor = (
            torch.frombuffer(bytearray(payload.data), dtype=getattr(torch, payload.dtype)) if payload.data else None
        )
        if fqn in contents.constants and (fqn not in buffers or tuple(buffers[fqn].shape) != payload.shape):
            raise ValueError(f"{path}: constant {fqn!r} is not a buffer of the model")
        if tensor is not None:
            pretrained.check_finite({fqn: tensor}, path)
    fresh = archive.repack_pt2(contents, sample_inputs=b"")  # empty: torch unpickles no sample inputs
    try:
        program = torch.export.load(io.BytesIO(fresh))
        graph = program.module()
    except ImportError as error:  # a module torch.export needs (networkx): the real cause, by name
        raise ImportError(
            f"{path}: loading a .pt2 needs the module {error.name or str(error)!r}, which cannot be imported: {error}",
            name=error.name,
        ) from error
    except Exception as error:  # torch raises many types on programs it cannot rebuild
        raise ValueError(f"{path}: torch.export cannot rebuild the program: {error}") from None
    return CheckedProgram(graph.requires_grad_(False), contents.meta["config"], path, contents.meta.get("max_length"))


# ---- ONNX --------------------------------------------------------------------------------


class CheckedOnnx(CheckedProgram):
    """An onnxruntime session behind the same input checks, fed and read as torch tensors
    (the logits come back on the tokens' device)."""

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        tokens, mask = check_token_inputs(tokens, mask, self.config["vocab_size"], self.max_length)
        feed = {"tokens": tokens.cpu().numpy(), "mask": mask.cpu().numpy()}
        try:
            (logits,) = self.run.run(None, feed)
        except Exception as error:  # onnxruntime's own error types: a graph that cannot run this input
            raise ValueError(f"{self.where}: onnxruntime failed on this input: {error}") from None
        return torch.from_numpy(logits).to(tokens.device)


def _onnx_tensors(message, depth: int = 0):
    """Every TensorProto anywhere in an ONNX protobuf message: each set field is walked, so
    none is missed (initialisers, sparse tensors' values and indices, node attributes,
    subgraphs, functions' nodes)."""
    if depth > 64:
        raise ValueError("the ONNX model nests deeper than 64 levels")
    if message.DESCRIPTOR.full_name == "onnx.TensorProto":
        yield message
        return
    for field, value in message.ListFields():
        if field.message_type is None:
            continue  # a number, a string, bytes: no tensor inside
        for item in [value] if hasattr(value, "DESCRIPTOR") else value:  # one message, or a repeated field
            yield from _onnx_tensors(item, depth + 1)


def _load_onnx(path: Path) -> CheckedOnnx:
    import numpy
    import onnx
    import onnxruntime

    data = _read_bytes(path, "onnx")
    try:
        proto = onnx.load_model_from_string(data)  # from bytes: external data is never opened
    except Exception as error:  # protobuf's DecodeError
        raise ValueError(f"{path} is not a valid ONNX model: {error}") from None
    try:
        tensors = list(_onnx_tensors(proto))
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{path} is not a valid ONNX model: {error}") from None
    for tensor in tensors:  # before the checker, which would look for those files on disk
        if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.external_data):
            raise ValueError(f"{path}: tensor {tensor.name!r} refers to external data; only self-contained files load")
    try:
        onnx.checker.check_model(proto)
    except Exception as error:  # the checker's ValidationError
        raise ValueError(f"{path} is not a valid ONNX model: {error}") from None
    props = {p.key: p.value for p in proto.metadata_props}
    try:
        meta = json.loads(props.get("probformer", "null"))
    except (json.JSONDecodeError, RecursionError):
        meta = None
    if meta is None:
        raise ValueError(f"{path}: an ONNX model, but not a probformer export (no {ONNX_FORMAT!r} record)")
    named = registry.LogitsOnly(_model_of(meta, ONNX_FORMAT, f"{path} (metadata 'probformer')")).state_dict()
    _check_onnx_signature(proto, path)
    for tensor in proto.graph.initializer:  # those named after a parameter; others are graph constants (-inf masks)
        if tensor.name in named:
            values = onnx.numpy_helper.to_array(tensor).astype("f4")
            if tuple(values.shape) != tuple(named[tensor.name].shape) or not numpy.isfinite(values).all():
                raise ValueError(f"{path}: initialiser {tensor.name!r} is not a finite tensor of the config's shape")
    try:
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime's own error types
        raise ValueError(f"{path}: onnxruntime cannot open it: {error}") from None
    return CheckedOnnx(session, meta["config"], path, meta.get("max_length"))


def _check_onnx_signature(proto, path: Path) -> None:
    """Inputs ``tokens`` int64 [B, n] and ``mask`` bool [B, n]; one output ``logits``."""
    import onnx

    declared = {i.name: (i.type.tensor_type.elem_type, len(i.type.tensor_type.shape.dim)) for i in proto.graph.input}
    wanted = {"tokens": (onnx.TensorProto.INT64, 2), "mask": (onnx.TensorProto.BOOL, 2)}
    outputs = [o.name for o in proto.graph.output]
    if declared != wanted or outputs != ["logits"]:
        raise ValueError(f"{path}: graph inputs {declared} and outputs {outputs}; expected {wanted} -> ['logits']")
