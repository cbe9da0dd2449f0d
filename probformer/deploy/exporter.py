"""Export a trained model for deployment, and load what was exported (docs/export.md).

    export(model, path, format="torch")     a directory: config.json, model.safetensors and
                                            probformer_runtime.py (the loader: torch and
                                            safetensors only)
    export(model, path, format="exported")  a torch.export ExportedProgram (.pt2) with a
                                            dynamic batch and sequence length
    export(model, path, format="onnx")      ONNX through torch's exporter, checked with
                                            onnxruntime

Every format holds the inference forward pass of ``probformer.models.blocks``: mean-field
iterations unrolled, resampling by its fixed argmax rule. ``export`` runs the artefact
it wrote on an example batch and refuses to finish unless it matches the source model.
``load`` reads any of the three and never unpickles: safetensors for weights, and a
.pt2 archive is opened only if every tensor in it is stored raw (torch.export.load
would otherwise fall back to pickle).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import tempfile
import warnings
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from probformer.models import blocks as runtime

__all__ = ["export", "load", "to_runtime", "FORMATS"]

FORMATS = ("torch", "exported", "onnx")
EXPORTED_FORMAT = "probformer-exported/1"
ONNX_FORMAT = "probformer-onnx/1"
RUNTIME_FILE = "probformer_runtime.py"
TOLERANCE = 1e-5


# ---- the runtime twin of a trainable model ------------------------------------------


def _kind_and_config(model) -> tuple[str, dict]:
    from probformer.training.checkpoint import MODELS

    kind = next((k for k, (_, cls) in MODELS.items() if isinstance(model, cls)), None)
    if kind is None:
        raise ValueError(f"cannot export a {type(model).__name__}; known models: {sorted(MODELS)}")
    if kind not in runtime.RUNTIMES:
        raise ValueError(f"a {kind} cannot be exported yet; the runtime has {sorted(runtime.RUNTIMES)}")
    if kind != "probabilistic_transformer":
        return kind, asdict(model.config)
    engine, crf = model.mean_field, model.crf
    if engine.schedule not in ("async", "parallel"):
        raise ValueError(f"schedule {engine.schedule!r} cannot be exported; allowed: ['async', 'parallel']")
    if engine.damping != (0.0, 0.0) or engine.step_size != (1.0, 1.0):
        raise ValueError("mean field with damping or step sizes cannot be exported (the runtime has neither)")
    extras = {
        "halting": engine.halting != "none",
        "span": engine.span is not None,
        "global_memory='product_key'": crf.global_memory != "dense",
    }
    if any(extras.values()):
        names = [name for name, used in extras.items() if used]
        raise ValueError(f"the runtime has no {', '.join(names)} yet: this model cannot be exported")
    topology = crf.topology.name
    for n in range(1, 13):  # the runtime restates the topology rules: they must agree
        try:
            same = torch.equal(runtime.topology_mask(topology, n), crf.topology.mask(n))
        except ValueError:
            same = False
        if not same:
            raise ValueError(f"topology {topology!r} cannot be exported: the runtime does not reproduce it")
    config = {k: getattr(model.config, k) for k in ("vocab_size", "task", "num_classes", "pooling")}
    config.update(
        labels=crf.labels,
        channels=crf.channels,
        rank=crf.ternary_factors()[0].shape[-1],  # the effective rank of any ternary form
        global_labels=crf.global_labels,
        topology=topology,
        gamma=crf.gamma,
        iterations=engine.iterations,
        schedule=engine.schedule,
        scales=engine.scales(),  # weights times μP factors: the runtime needs no μP code
    )
    return kind, config


def to_runtime(model) -> tuple[nn.Module, dict]:
    """``(runtime model, meta)``: the inference-only twin of ``model`` (same weights, eval
    mode) and the ``config.json`` content that rebuilds it."""
    kind, config = _kind_and_config(model)
    with torch.device("meta"):  # dtype and device come from the source's tensors
        twin = runtime.RUNTIMES[kind](config)
    source = model.state_dict()
    if kind == "probabilistic_transformer":  # CP / Tucker forms: export the factors they compute
        source.update(zip(("crf.ternary_u", "crf.ternary_v"), model.crf.ternary_factors()))
    twin.load_state_dict({k: source[k].detach().clone() for k in twin.state_dict()}, assign=True)
    twin.requires_grad_(False)
    meta = {"format": runtime.FORMAT, "model": kind, "config": config}
    return twin.eval(), meta


# ---- export ------------------------------------------------------------------------


def _example(model, example) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch to check the artefact on: the caller's, or three padded rows."""
    if example is None:
        vocab_size = model.config.vocab_size
        limit = min(getattr(model.config, "max_length", 9), 9)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (3, limit), generator=generator)
        lengths = torch.tensor([limit, max(1, limit - 3), 1])
        return tokens, torch.arange(limit)[None, :] < lengths[:, None]
    tokens, mask = example if isinstance(example, tuple | list) else (example, None)
    return runtime.check_token_inputs(tokens, mask, model.config.vocab_size, getattr(model.config, "max_length", None))


def _trace_inputs(twin) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2, length 5: sizes other than 0 and 1, so torch.export keeps both dynamic."""
    length = min(5, twin.config.get("max_length", 5))
    tokens = torch.zeros(2, max(length, 2), dtype=torch.long)
    return tokens, torch.ones_like(tokens, dtype=torch.bool)


def _dynamic_shapes(twin):
    limit = twin.config.get("max_length")
    batch = torch.export.Dim("batch", min=1)
    length = torch.export.Dim("length", min=1, max=limit) if limit else torch.export.Dim("length", min=1)
    return {"tokens": {0: batch, 1: length}, "mask": {0: batch, 1: length}}


def export(model, path, format: str = "torch", example=None, vocabulary=None, tolerance: float = TOLERANCE) -> Path:
    """Write ``model`` (a trainable model, or the path of a checkpoint or run folder) to
    ``path``; returns ``path``.

    ``example``: tokens ``[B, n]`` or ``(tokens, mask)`` to check the artefact on (default:
    three random rows, two of them padded). ``vocabulary`` (taken from the checkpoint when
    ``model`` is a path) is written next to a "torch" export as vocabulary.json (and
    tokenizer.json for a subword vocabulary). Raises if the artefact's logits differ from
    the source's by more than ``tolerance`` anywhere.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    if isinstance(model, str | Path):
        from probformer.training.evaluate import load_any

        model, stored = load_any(model)
        vocabulary = vocabulary or stored
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a probformer model or a checkpoint path, got {type(model).__name__}")
    twin, meta = to_runtime(model)
    tokens, mask = _example(model, example)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        expected = model(tokens, mask)[0]
    model.train(was_training)
    writer = {"torch": _write_directory, "exported": _write_exported, "onnx": _write_onnx}[format]

    def write_and_check(target: Path) -> None:
        writer(target, twin, meta, vocabulary)
        with torch.no_grad():
            found = load(target)(tokens, mask)
        error = (found.float() - expected.float()).abs().max().item()
        if not error <= tolerance:
            raise RuntimeError(f"the export differs from the source model by {error:.3g} > tolerance {tolerance:g}")

    path = Path(path)
    _replace(path, write_and_check)
    return path


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


def _write_directory(folder: Path, twin, meta, vocabulary) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in twin.state_dict().items()}
    header = {"format": meta["format"], "model": meta["model"]}
    save_file(weights, str(folder / "model.safetensors"), metadata=header)
    (folder / "config.json").write_text(json.dumps(meta, indent=1))
    shutil.copyfile(runtime.__file__, folder / RUNTIME_FILE)
    if vocabulary is not None:
        (folder / "vocabulary.json").write_text(json.dumps(vocabulary.words))
        if hasattr(vocabulary, "tokenizer"):
            vocabulary.save(folder / "tokenizer.json")


def _write_exported(target: Path, twin, meta, vocabulary) -> None:
    tokens, mask = _trace_inputs(twin)
    program = torch.export.export(twin, (tokens, mask), dynamic_shapes=_dynamic_shapes(twin))
    extra = {"probformer.json": json.dumps({**meta, "format": EXPORTED_FORMAT})}
    torch.export.save(program, str(target), extra_files=extra)


def _write_onnx(target: Path, twin, meta, vocabulary) -> None:
    import onnx

    tokens, mask = _trace_inputs(twin)
    with warnings.catch_warnings():  # the exporter's notes on axis names
        warnings.simplefilter("ignore")
        _onnx_export(twin, tokens, mask, target)
    proto = onnx.load(str(target))
    onnx.helper.set_model_props(proto, {"probformer": json.dumps({**meta, "format": ONNX_FORMAT})})
    onnx.save(proto, str(target))


def _onnx_export(twin, tokens, mask, target: Path) -> None:
    # the exporter prints progress to stdout and logs that torchvision ops are absent
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            torch.onnx.export(
                twin,
                (tokens, mask),
                str(target),
                input_names=["tokens", "mask"],
                output_names=["logits"],
                dynamic_shapes=_dynamic_shapes(twin),
                external_data=False,  # one self-contained file (weights < 2 GB)
                dynamo=True,
                verbose=False,
            )
    finally:
        registry.setLevel(level)


# ---- load -----------------------------------------------------------------------------


def load(path):
    """What ``export`` wrote, ready to call as ``model(tokens, mask) -> logits``:

    - a "torch" directory: the ``probformer.models.blocks`` module (an ``nn.Module``);
    - a .pt2 file: the ExportedProgram's module, behind ``Checked`` (input checks);
    - an .onnx file: an onnxruntime session behind ``Checked`` (torch tensors in/out).

    Anything else, or a file that is not what it claims, raises ``ValueError`` (or
    ``FileNotFoundError``) naming the file.
    """
    path = Path(path)
    if path.is_dir():
        return runtime.load(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported model at {path}")
    with path.open("rb") as file:
        magic = file.read(4)
    if magic == b"PK\x03\x04":
        return _load_exported(path)
    return _load_onnx(path)


def _load_exported(path: Path):
    """Open the .pt2 archive only if it is ours and nothing in it needs unpickling:
    torch.export.load unpickles entries marked ``use_pickle`` and retries sample inputs
    with ``weights_only=False``; refuse both cases before calling it."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            ours = [n for n in names if n.endswith("extra/probformer.json")]
            meta = json.loads(archive.read(ours[0])) if ours else {}
            configs = {n: json.loads(archive.read(n)) for n in names if n.endswith("_config.json")}
            pickled = {n: archive.read(n) for n in names if n.endswith((".pt", ".pkl", ".pickle"))}
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError) as error:
        raise ValueError(f"{path} is not a readable .pt2 archive: {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORTED_FORMAT or meta.get("model") not in runtime.RUNTIMES:
        raise ValueError(
            f"{path}: not a probformer torch.export file (no {EXPORTED_FORMAT!r} record; foreign or damaged)"
        )
    if not any(n.endswith("weights_config.json") for n in configs):
        raise ValueError(f"{path}: no weights_config.json in the archive (an old or foreign .pt2 layout)")
    for config in configs.values():
        entries = config.get("config", {}) if isinstance(config, dict) else None
        for name, entry in (entries or {}).items():
            if not isinstance(entry, dict) or entry.get("use_pickle", True) or "tensor_meta" not in entry:
                raise ValueError(f"{path}: entry {name!r} is not a raw tensor; refusing to unpickle it")
    for name, content in pickled.items():
        if "/sample_inputs/" not in name:
            raise ValueError(f"{path}: unexpected pickle {name!r} in the archive; refusing to load it")
        try:
            torch.load(io.BytesIO(content), weights_only=True)
        except Exception as error:  # the weights-only unpickler rejects anything but tensors
            raise ValueError(f"{path}: {name!r} is not plain tensors ({error}); refusing to load it") from None
    try:
        program = torch.export.load(str(path))
    except Exception as error:  # torch raises many types on a damaged archive
        raise ValueError(f"{path}: torch.export cannot read it: {error}") from None
    return Checked(program.module(), meta)


class Checked:
    """An exported graph called like the torch model, ``(tokens, mask) -> logits``, with
    the input checks the graph itself cannot make (token ids in range, a real token per
    row). ``onnx``: an onnxruntime session, fed and read as torch tensors."""

    def __init__(self, graph, meta: dict, onnx: bool = False):
        self.graph, self.meta, self.onnx = graph, meta, onnx

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        config = self.meta["config"]
        tokens, mask = runtime.check_token_inputs(tokens, mask, config["vocab_size"], config.get("max_length"))
        if not self.onnx:
            return self.graph(tokens, mask)
        (logits,) = self.graph.run(None, {"tokens": tokens.cpu().numpy(), "mask": mask.cpu().numpy()})
        return torch.from_numpy(logits)


def _load_onnx(path: Path) -> Checked:
    import onnx
    import onnxruntime

    try:
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
    except Exception as error:  # protobuf's DecodeError and the checker's ValidationError
        raise ValueError(f"{path} is neither a probformer export nor a valid ONNX model: {error}") from None
    props = {p.key: p.value for p in proto.metadata_props}
    try:
        meta = json.loads(props.get("probformer", "{}"))
    except json.JSONDecodeError:
        meta = {}
    if meta.get("format") != ONNX_FORMAT or meta.get("model") not in runtime.RUNTIMES:
        raise ValueError(f"{path}: an ONNX model, but not a probformer export (no {ONNX_FORMAT!r} record)")
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return Checked(session, meta, onnx=True)
