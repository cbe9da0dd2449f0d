"""The valid artefacts the reader tests start from, written here (not by the exporter) with
torch.export.save / torch.onnx.export of ``LogitsOnly(model)`` in the formats the exporter
writes (docs/export.md): a tiny model, a batch, the torch folder, the ``.pt2`` archive and
the ONNX file, the source model's logits, the check that ``reader.load`` refuses a path
with a message naming it, and the hypothesis settings of the reader's property tests."""

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from safetensors.torch import save_file

from probformer.deploy import reader
from probformer.models.registry import LogitsOnly, build

torch.set_num_threads(1)


VOCAB = 40


TRANSFORMER = dict(vocab_size=VOCAB, width=16, heads=2, layers=1, ffn_width=32, max_length=20)


PT = dict(vocab_size=VOCAB, labels=12, channels=2, rank=3, global_labels=3, gamma=1, iterations=2, topology="full")


HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def tiny(kind="transformer", config=TRANSFORMER):
    torch.manual_seed(0)
    return build(kind, config).eval()


def batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 7), generator=generator)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 4, 1])[:, None]
    return tokens, mask


def record(kind, model, fmt):
    return {"format": fmt, "model": kind, "config": model.config.to_dict()}


def unique_state(model) -> dict:
    """Every shared tensor once, as the exporter stores it (safetensors refuses aliases)."""
    seen, unique = set(), {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = tensor.detach().contiguous()
    return unique


def write_folder(folder: Path, kind="transformer", model=None) -> Path:
    model = model if model is not None else tiny()
    folder.mkdir(parents=True)
    save_file(unique_state(model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(record(kind, model, reader.TORCH_FORMAT)))
    return folder


def dynamic_shapes():
    batch_dim, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=1, max=20)
    return {"tokens": {0: batch_dim, 1: length}, "mask": {0: batch_dim, 1: length}}


def trace_inputs():
    return torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)


def write_pt2(path: Path, model) -> Path:
    program = torch.export.export(LogitsOnly(model).eval(), trace_inputs(), dynamic_shapes=dynamic_shapes())
    meta = json.dumps(record("transformer", model, reader.EXPORTED_FORMAT))
    torch.export.save(program, str(path), extra_files={"probformer.json": meta})
    return path


def write_onnx(path: Path, model) -> Path:
    import onnx

    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    registry_log.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            LogitsOnly(model).eval(),
            trace_inputs(),
            str(path),
            input_names=["tokens", "mask"],
            output_names=["logits"],
            dynamic_shapes=dynamic_shapes(),
            external_data=False,
            dynamo=True,
            verbose=False,
        )
    proto = onnx.load(str(path))
    onnx.helper.set_model_props(proto, {"probformer": json.dumps(record("transformer", model, reader.ONNX_FORMAT))})
    onnx.save(proto, str(path))
    return path


def expected_logits(model, tokens, mask):
    with torch.no_grad():
        return model(tokens, mask)[0]


def assert_refused(path, *fragments, error=ValueError):
    with pytest.raises(error) as caught:
        reader.load(path)
    assert str(path) in str(caught.value) or str(Path(path).parent) in str(caught.value)
    for fragment in fragments:
        assert fragment in str(caught.value)
