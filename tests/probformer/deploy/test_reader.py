"""Loading a crafted file never runs code from it.

The code-execution attacks on ``torch.export.load`` are rebuilt here from a real export:
each test first shows that plain torch runs the payload (it creates a marker file), then
that ``probformer.deploy.reader.load`` refuses the same file with a ``ValueError`` and the
marker never appears. Hand-made and hypothesis-made damage to valid artefacts (byte
flips, truncations, bad zip structure, folders with symlinks or pickles, ONNX external
data, wrong inputs to the wrappers) must end in ``ValueError`` / ``FileNotFoundError`` or
in a model that still computes the source model's logits: never another exception.
The valid artefacts are written here with torch.export.save / torch.onnx.export of
``LogitsOnly(model)``, in the formats the exporter writes (docs/export.md).
"""

import contextlib
import io
import json
import logging
import pickle
import struct
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from probformer.deploy import archive, reader
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


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("artefacts")
    return {
        "folder": write_folder(root / "folder", model=model),
        "pt2": write_pt2(root / "model.pt2", model),
        "onnx": write_onnx(root / "model.onnx", model),
    }


def expected_logits(model, tokens, mask):
    with torch.no_grad():
        return model(tokens, mask)[0]


def assert_refused(path, *fragments, error=ValueError):
    with pytest.raises(error) as caught:
        reader.load(path)
    assert str(path) in str(caught.value) or str(Path(path).parent) in str(caught.value)
    for fragment in fragments:
        assert fragment in str(caught.value)


# ---- valid artefacts load and compute the source model's logits -----------------------


@pytest.mark.parametrize("fmt, tolerance", [("folder", 0.0), ("pt2", 0.0), ("onnx", 1e-5)])
def test_valid_artefacts_reproduce_the_source_model(artefacts, model, fmt, tolerance):
    loaded = reader.load(artefacts[fmt])
    tokens, mask = batch()
    with torch.no_grad():
        found = loaded(tokens, mask)
    assert (found - expected_logits(model, tokens, mask)).abs().max().item() <= tolerance


def test_folder_with_shared_tensors_loads_each_once(tmp_path):
    pt = tiny("probabilistic_transformer", PT)
    assert len(unique_state(pt)) < len(pt.state_dict())  # the PT's crf is also mean_field.crf
    folder = write_folder(tmp_path / "pt", "probabilistic_transformer", pt)
    tokens, mask = batch()
    with torch.no_grad():
        assert torch.equal(reader.load(folder)(tokens, mask), expected_logits(pt, tokens, mask))
    weights = {**unique_state(pt), "mean_field.crf.unary": pt.crf.unary.detach().clone()}  # stored twice
    save_file(weights, str(folder / "model.safetensors"))
    assert_refused(folder, "stored 2 times")


def test_bf16_folder_loads_in_bf16(tmp_path, model):
    half = tiny().to(torch.bfloat16)
    folder = write_folder(tmp_path / "bf16", model=half)
    loaded = reader.load(folder)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    tokens, mask = batch()
    with torch.no_grad():
        assert torch.equal(loaded(tokens, mask), expected_logits(half, tokens, mask))


# ---- the code-execution attacks on torch.export.load, rebuilt --------------------------


class Payload:
    """Unpickling this creates the marker file: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def entries_of(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as source:
        return {info.filename: source.read(info) for info in source.infolist()}


def write_torch_archive(path: Path, entries: dict[str, bytes]) -> Path:
    """An archive in torch's own zip layout (its writer), so only the content is crafted."""
    from torch.export.pt2_archive import PT2ArchiveWriter

    with PT2ArchiveWriter(str(path)) as writer:
        for name, data in entries.items():
            name = name.split("/", 1)[1]
            if name not in (".data/version", ".data/serialization_id", "byteorder"):  # the writer adds these
                writer.write_bytes(name, data)
    return path


def write_plain_zip(path: Path, items: list, external_attr: int = 0, tail: bytes = b"", gap: bytes = b"") -> Path:
    """A stored zip written byte by byte: no extra fields, no attributes unless asked (what
    the strict reader accepts), but anything torch's writer never writes: duplicate names,
    odd names, symlink attributes, bytes after the end."""
    local, central = bytearray(), bytearray()
    for name, data in items:
        raw, crc = name.encode(), zlib.crc32(data)
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0)
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                0,
                0,
                0,
                crc,
                len(data),
                len(data),
                len(raw),
                0,
                0,
                0,
                0,
                external_attr,
                len(local),
            )
            + raw
        )
        local += header + raw + data + gap  # gap: bytes no entry owns
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(items), len(items), len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end) + tail)
    return path


def torch_runs_it(path: Path, marker: Path) -> bool:
    """Load ``path`` with plain torch (and run the module on a batch): did the payload run?"""
    marker.unlink(missing_ok=True)
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch._export.serde.serialize").disabled = True
        torch.export.load(str(path)).module()(*batch())
    logging.getLogger("torch._export.serde.serialize").disabled = False
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def key(entries, suffix):
    return next(name for name in entries if name.endswith(suffix))


def duplicate_config(tmp_path, valid, marker) -> Path:
    """(a) Two entries named like the weights config: the pickled one is read by torch's
    reader (a binary search over the sorted names), the benign one by Python's zipfile
    (the last of a name). Tried at every position until torch picks the pickled one."""
    entries = entries_of(valid)
    name = key(entries, "data/weights/model_weights_config.json")
    config = json.loads(entries[name])
    evil = json.loads(json.dumps(config))
    evil["config"][next(iter(evil["config"]))].update(use_pickle=True, path_name="weight_99")
    crafted = [(name, json.dumps(evil).encode()), (name.replace("model_weights_config.json", "weight_99"), b"")]
    crafted[1] = (crafted[1][0], pickled(Payload(marker)))
    items = list(entries.items())
    for position in range(len(items) + 1):
        path = write_plain_zip(tmp_path / "duplicate.pt2", items[:position] + crafted + items[position:])
        with zipfile.ZipFile(path) as check:
            benign_for_zipfile = b"weight_99" not in check.read(name)
        if benign_for_zipfile and torch_runs_it(path, marker):
            return path
    pytest.skip(f"torch {torch.__version__} never reads the pickled duplicate: nothing to demonstrate")


def opaque_constant(tmp_path, valid, marker) -> Path:
    """(b) A constant stored as a pickled opaque object, named in the constants config."""
    entries = entries_of(valid)
    name = key(entries, "data/constants/model_constants_config.json")
    evil = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
    config = {"config": {"evil": evil}}
    entries[name] = json.dumps(config).encode()
    entries[name.replace("model_constants_config.json", "opaque_obj_0")] = pickle.dumps(Payload(marker))
    return write_torch_archive(tmp_path / "opaque.pt2", entries)


def pickled_weight(tmp_path, valid, marker) -> Path:
    """A weight flagged ``use_pickle``: torch.load(weights_only=False) on its bytes."""
    entries = entries_of(valid)
    name = key(entries, "data/weights/model_weights_config.json")
    config = json.loads(entries[name])
    entry = config["config"][next(iter(config["config"]))]
    entry["use_pickle"] = True
    entries[name] = json.dumps(config).encode()
    entries[key(entries, "data/weights/" + entry["path_name"])] = pickled(Payload(marker))
    return write_torch_archive(tmp_path / "pickled_weight.pt2", entries)


def sample_inputs(tmp_path, valid, marker) -> Path:
    """Sample inputs the weights-only unpickler refuses: torch retries with weights_only=False."""
    entries = entries_of(valid)
    entries[key(entries, "data/sample_inputs/model.pt")] = pickled(Payload(marker))
    return write_torch_archive(tmp_path / "sample_inputs.pt2", entries)


def shape_expression(tmp_path, valid, marker) -> Path:
    """A shape expression: the deserializer hands it to sympy.sympify, which evaluates it."""
    entries = entries_of(valid)
    name = key(entries, "models/model.json")
    symbol = "Symbol('s27', positive=True, integer=True)"
    program = entries[name].decode()
    symbol = program[program.index("Symbol('s") :].split(")", 1)[0] + ")"
    evil = f"(open({str(marker)!r}, 'w') and {symbol})"
    entries[name] = program.replace(f'"expr_str": "{symbol}"', f'"expr_str": "{evil}"', 1).encode()
    return write_torch_archive(tmp_path / "expression.pt2", entries)


def with_program(valid, path: Path, edit) -> Path:
    """``valid`` with its program JSON changed in place by ``edit(program)``, written to ``path``."""
    entries = entries_of(valid)
    name = key(entries, "models/model.json")
    program = json.loads(entries[name])
    edit(program)
    entries[name] = json.dumps(program).encode()
    return write_torch_archive(path, entries)


def signature(program) -> dict:
    return program["graph_module"]["module_call_graph"][0]["signature"]


def guard_code(tmp_path, valid, marker) -> Path:
    """Guard code: ExportedProgram.module() compiles it into the module's input check."""
    return with_program(
        valid, tmp_path / "guards.pt2", lambda p: p["guards_code"].append(f"open({str(marker)!r}, 'w') is not None")
    )


def foreign_target(tmp_path, valid, marker) -> Path:
    """A node calling a function outside ATen (resolved by attribute lookup under torch)."""

    def edit(program):
        program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.serialization.load"

    return with_program(valid, tmp_path / "target.pt2", edit)


def forward_argument_names(tmp_path, valid, marker) -> Path:
    """Argument names: torch writes them into the ``def forward(...)`` it generates and runs,
    so a default value there ran while the model loaded."""

    def edit(program):
        signature(program)["forward_arg_names"].append(f"_x=open({str(marker)!r}, 'w')")

    return with_program(valid, tmp_path / "arguments.pt2", edit)


def spec_dict_key(tmp_path, valid, marker) -> Path:
    """A dict key of the input spec: torch writes it into the generated forward as text."""

    def edit(program):
        spec = json.loads(signature(program)["in_spec"])
        spec[1]["children_spec"][1]["context"] = json.dumps([f"k'+str(open({str(marker)!r}, 'w'))+'"])
        signature(program)["in_spec"] = json.dumps(spec)

    return with_program(valid, tmp_path / "spec.pt2", edit)


ATTACKS = {
    "forward_argument_names": (forward_argument_names, "forward arguments"),
    "spec_dict_key": (spec_dict_key, "dict keys that are not names"),
    "duplicate_name": (duplicate_config, "duplicate archive entry"),
    "opaque_object": (opaque_constant, "unexpected archive entry"),
    "pickled_weight": (pickled_weight, "asks for unpickling"),
    "sample_inputs": (sample_inputs, None),
    "shape_expression": (shape_expression, "shape expression"),
    "guard_code": (guard_code, None),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_code_execution_attacks_run_in_torch_but_not_in_load(tmp_path, artefacts, model, attack):
    craft, fragment = ATTACKS[attack]
    marker = tmp_path / "marker"
    path = craft(tmp_path, artefacts["pt2"], marker)
    if attack != "duplicate_name" and not torch_runs_it(path, marker):  # duplicate_name checked it already
        pytest.skip(f"torch {torch.__version__} itself refuses the {attack} attack: nothing to demonstrate")
    if fragment is None:  # refused, or loaded with the dangerous part dropped: it computes the model
        with contextlib.suppress(ValueError):
            loaded = reader.load(path)
            tokens, mask = batch()
            assert torch.equal(loaded(tokens, mask), expected_logits(model, tokens, mask))
    else:
        assert_refused(path, fragment)
    assert not marker.exists()


def test_calls_outside_aten_are_refused(tmp_path, artefacts):
    assert_refused(foreign_target(tmp_path, artefacts["pt2"], tmp_path / "marker"), "only ATen operators")


# ---- zip structure: only exactly the layout torch writes is read -----------------------


def valid_items(artefacts):
    return list(entries_of(artefacts["pt2"]).items())


ZIP_CASES = {
    "parent folder": (lambda items: [("../evil", b"x")] + items, "not a plain relative path"),
    "absolute name": (lambda items: [("/etc/evil", b"x")] + items, "not a plain relative path"),
    "backslash": (lambda items: [("model\\..\\evil", b"x")] + items, "not a plain relative path"),
    "dot folder": (lambda items: [("model/./evil", b"x")] + items, "not a plain relative path"),
    "duplicate": (lambda items: items + [items[0]], "duplicate archive entry"),
    "extra entry": (lambda items: items + [("model/data/weights/evil.pkl", b"x")], "unexpected archive entry"),
    "two roots": (lambda items: items + [("other/archive_format", b"pt2")], "one root folder"),
    "no program": (lambda items: [i for i in items if not i[0].endswith("model.json")], "missing entries"),
}


@pytest.mark.parametrize("case", sorted(ZIP_CASES))
def test_archives_not_in_our_layout_are_refused(tmp_path, artefacts, case):
    change, fragment = ZIP_CASES[case]
    assert_refused(write_plain_zip(tmp_path / "case.pt2", change(valid_items(artefacts))), fragment)


def test_symlinks_hidden_bytes_and_compression_are_refused(tmp_path, artefacts):
    items = valid_items(artefacts)
    symlink = write_plain_zip(tmp_path / "link.pt2", items, external_attr=(0o120777 << 16))
    assert_refused(symlink, "file attributes")
    assert_refused(write_plain_zip(tmp_path / "tail.pt2", items, tail=b"hidden"), "end record")
    data = write_plain_zip(tmp_path / "plain.pt2", items).read_bytes()
    (tmp_path / "head.pt2").write_bytes(b"PK\x03\x04" + data)  # the directory's offset is now wrong
    assert_refused(tmp_path / "head.pt2", "between the central directory and the end record")
    assert_refused(write_plain_zip(tmp_path / "gap.pt2", items, gap=b"hidden"), "not where the previous one ended")
    with zipfile.ZipFile(tmp_path / "deflated.pt2", "w", zipfile.ZIP_DEFLATED) as out:
        for name, content in items:
            out.writestr(name, content)
    assert_refused(tmp_path / "deflated.pt2", "compressed")
    with zipfile.ZipFile(tmp_path / "foreign.pt2", "w") as out:
        out.writestr("hello.txt", "a zip that is not a model")
    assert_refused(tmp_path / "foreign.pt2")


def test_the_strict_reader_reads_torch_archives_as_zipfile_does(artefacts):
    data = artefacts["pt2"].read_bytes()
    assert archive.read_zip(data, "model.pt2") == entries_of(artefacts["pt2"])


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04", b"PK\x03\x04" + b"\0" * 100, b"not a model", b"\x08\x01"])
@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_empty_and_foreign_files_are_refused(tmp_path, content, suffix):
    path = tmp_path / f"file{suffix}"
    path.write_bytes(content)
    assert_refused(path)


def test_missing_paths_raise_file_not_found(tmp_path):
    assert_refused(tmp_path / "nothing.pt2", error=FileNotFoundError)
    (tmp_path / "folder").mkdir()
    assert_refused(tmp_path / "folder", error=FileNotFoundError)


def test_the_program_check_refuses_what_torch_would_evaluate():
    for text in ["__import__('os')", "Symbol('s0').__class__", "Pow(Integer(10), Integer(10000000))", "x" * 20_000]:
        with pytest.raises(ValueError, match="shape expression"):
            archive.check_program({"graph_module": {"graph": {"nodes": [{"expr_str": text}]}}}, "p")
    good = "Mul(Integer(2), Pow(Symbol('s27', positive=True, integer=True), Integer(2)))"
    assert archive.check_program({"graph_module": {"x": {"expr_str": good}}}, "p")["graph_module"]["x"]["expr_str"]
    for program in [
        {"graph_module": {"nodes": [{"target": "builtins.eval"}]}},
        {"graph_module": {"nodes": [{"target": "torch.ops.aten.from_file.default"}]}},
        {"graph_module": {"nodes": [{"name": "x = 1"}]}},
        {"graph_module": {"custom_obj_values": {"a": 1}}},
        {"graph_module": {"in_spec": '[1, {"type": "os.system", "children_spec": []}]'}},
        {"graph_module": {}, "verifiers": ["EVIL"]},
        {"graph_module": {}, "unknown": 1},
    ]:
        with pytest.raises(ValueError):
            archive.check_program(program, "p")
    stripped = archive.check_program({"graph_module": {"metadata": {"stack_trace": "x"}}, "guards_code": ["1"]}, "p")
    assert stripped == {"graph_module": {"metadata": {}}, "guards_code": []}


# ---- random damage: refused, or still the same model -------------------------------------


def damaged(data: bytes, position: int, flip: int, cut: bool) -> bytes:
    position %= len(data)
    if cut:
        return data[:position]
    return data[:position] + bytes([data[position] ^ flip]) + data[position + 1 :]


def outcome(path, model):
    """``"refused"`` or ``"same"``; anything else fails the test."""
    try:
        loaded = reader.load(path)
        tokens, mask = batch()
        with torch.no_grad():
            found = loaded(tokens, mask)
    except (ValueError, FileNotFoundError):
        return "refused"
    assert torch.allclose(found, expected_logits(model, tokens, mask), atol=1e-5)  # damage that changes nothing
    return "same"


@HYPOTHESIS
@given(position=st.integers(0, 10**9), flip=st.integers(1, 255), cut=st.booleans())
def test_damaged_pt2_is_refused_or_unchanged(tmp_path, artefacts, model, position, flip, cut):
    path = tmp_path / "damaged.pt2"
    path.write_bytes(damaged(artefacts["pt2"].read_bytes(), position, flip, cut))
    outcome(path, model)


@HYPOTHESIS
@given(position=st.integers(0, 10**9), flip=st.integers(1, 255), cut=st.booleans())
def test_damaged_onnx_is_refused_or_runs(tmp_path, artefacts, model, position, flip, cut):
    """ONNX has no checksum: a flipped weight byte gives another (finite) model. Outcome:
    refused, or logits of the right shape; never another exception."""
    path = tmp_path / "damaged.onnx"
    path.write_bytes(damaged(artefacts["onnx"].read_bytes(), position, flip, cut))
    tokens, mask = batch()
    try:
        logits = reader.load(path)(tokens, mask)
    except (ValueError, FileNotFoundError):
        return
    assert logits.shape == (3, 7, VOCAB)


@HYPOTHESIS
@given(position=st.integers(0, 10**9), flip=st.integers(1, 255), cut=st.booleans(), which=st.booleans())
def test_damaged_folder_is_refused_or_runs(tmp_path, artefacts, model, position, flip, cut, which):
    """safetensors has no checksum either: a flipped weight byte gives another model, never
    a NaN one (non-finite weights are refused)."""
    folder = tmp_path / "damaged"
    if not folder.exists():
        write_folder(folder, model=model)
    name = "config.json" if which else "model.safetensors"
    original = (artefacts["folder"] / name).read_bytes()
    (folder / name).write_bytes(damaged(original, position, flip, cut))
    tokens, mask = batch()
    try:
        logits = reader.load(folder)(tokens, mask)
    except (ValueError, FileNotFoundError):
        return
    finally:
        (folder / name).write_bytes(original)
    assert logits.shape == (3, 7, VOCAB) and bool(torch.isfinite(logits).all())


# ---- the torch folder: JSON + safetensors, nothing else ----------------------------------


def test_folder_refuses_symlinks_code_and_unknown_files(tmp_path, artefacts):
    folder = write_folder(tmp_path / "f")
    for name, content in [
        ("model.py", b"import os"),
        ("weights.pkl", pickle.dumps(1)),
        ("model.pt", b"x"),
        (".x", b""),
    ]:
        (folder / name).write_bytes(content)
        assert_refused(folder, f"unexpected {name!r}")
        (folder / name).unlink()
    (folder / "sub").mkdir()
    assert_refused(folder, "unexpected 'sub'")
    (folder / "sub").rmdir()
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(artefacts["folder"] / "config.json")
    assert_refused(folder, "symlink")
    (folder / "config.json").unlink()
    assert_refused(folder, "config.json is missing", error=FileNotFoundError)


def test_folder_weights_must_be_safetensors_matching_the_config(tmp_path, model):
    folder = write_folder(tmp_path / "f", model=model)
    weights = unique_state(model)
    name = "embedding.weight"
    cases = {
        "pickle": None,
        "missing": {k: v for k, v in weights.items() if k != name},
        "unknown": {**weights, "evil": torch.zeros(1)},
        "shape": {**weights, name: torch.zeros(3, 3)},
        "dtype": {**weights, name: weights[name].long()},
        "two float dtypes": {**weights, name: weights[name].double()},
        "nan": {**weights, name: weights[name].clone().fill_(float("nan"))},
    }
    fragments = {"pickle": "not a readable safetensors", "missing": "missing", "unknown": "does not have"}
    fragments.update({"shape": "shape", "dtype": "dtype", "two float dtypes": "several dtypes", "nan": "NaN"})
    marker = tmp_path / "marker"
    for case, state in cases.items():
        if state is None:
            torch.save({name: Payload(marker), "pad": torch.zeros(4000)}, folder / "model.safetensors")
        else:
            save_file(state, str(folder / "model.safetensors"))
        assert_refused(folder, fragments[case])
    assert not marker.exists()


@pytest.mark.parametrize(
    "meta, fragment",
    [
        ({"format": "probformer-torch/1", "model": "transformer"}, "must have keys"),
        ({"format": "probformer-torch/9", "model": "transformer", "config": {}}, "format must be"),
        ({"format": reader.TORCH_FORMAT, "model": "os.system", "config": {}}, "unknown model kind"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": []}, "JSON object"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": {**TRANSFORMER, "evil": 1}}, "bad model"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": {**TRANSFORMER, "width": "16"}}, "bad"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": {**TRANSFORMER, "vocab_size": 10**12}}, ""),
        ([1, 2], "must have keys"),
    ],
)
def test_folder_config_is_read_strictly(tmp_path, meta, fragment):
    """A config describing more weights than the file holds (vocab_size=10**12) is refused
    before the model is allocated."""
    folder = write_folder(tmp_path / "f")
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused(folder, fragment)


def test_folder_vocabulary_must_fit_the_model(tmp_path):
    folder = write_folder(tmp_path / "f")
    (folder / "vocabulary.json").write_text(json.dumps(["w"] * VOCAB))
    assert reader.load(folder) is not None
    (folder / "vocabulary.json").write_text(json.dumps(["w"] * 3))
    assert_refused(folder, "vocab_size")
    (folder / "vocabulary.json").write_text('{"a": 1}')
    assert_refused(folder, "list of strings")


# ---- ONNX: self-contained files only --------------------------------------------------------


def test_onnx_external_data_is_refused(tmp_path, artefacts):
    import onnx

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 4096)
    folder = tmp_path / "onnx"
    folder.mkdir()
    proto = onnx.load(str(artefacts["onnx"]))
    tensor = proto.graph.initializer[0]
    onnx.external_data_helper.set_external_data(tensor, location="../secret.bin", offset=0, length=tensor.ByteSize())
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    (folder / "model.onnx").write_bytes(proto.SerializeToString())
    assert_refused(folder / "model.onnx")  # outside the folder: the checker or the external-data check
    inside = tmp_path / "inside"
    inside.mkdir()
    proto = onnx.load(str(artefacts["onnx"]))
    onnx.save_model(proto, str(inside / "model.onnx"), save_as_external_data=True, size_threshold=0, location="w.bin")
    assert_refused(inside / "model.onnx", "external data")  # inside the folder: refused too


def test_onnx_external_data_anywhere_in_the_model_is_refused(tmp_path, artefacts):
    """A Constant holding a sparse tensor whose values live in a file beside the process: the
    walk skipped sparse attributes, and onnxruntime read that file (from its current folder)."""
    import onnx
    from onnx import helper

    proto = onnx.load(str(artefacts["onnx"]))
    values = helper.make_tensor("sv", onnx.TensorProto.FLOAT, [1], b"\0\0\0\0", raw=True)
    onnx.external_data_helper.set_external_data(values, location="secret.bin", offset=0, length=4)
    values.ClearField("raw_data")
    values.data_location = onnx.TensorProto.EXTERNAL
    sparse = helper.make_sparse_tensor(values, helper.make_tensor("si", onnx.TensorProto.INT64, [1], [0]), [4])
    proto.graph.node.append(helper.make_node("Constant", [], ["leak"], sparse_value=sparse))
    onnx.save(proto, str(tmp_path / "sparse.onnx"))
    assert_refused(tmp_path / "sparse.onnx", "tensor 'sv' refers to external data")


def test_onnx_needs_the_probformer_record_and_signature(tmp_path, artefacts):
    import onnx

    proto = onnx.load(str(artefacts["onnx"]))
    del proto.metadata_props[:]
    onnx.save(proto, str(tmp_path / "bare.onnx"))
    assert_refused(tmp_path / "bare.onnx", "not a probformer export")
    proto = onnx.load(str(artefacts["onnx"]))
    proto.graph.input[1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    onnx.save(proto, str(tmp_path / "signature.onnx"))
    assert_refused(tmp_path / "signature.onnx")


# ---- inputs to the wrappers ------------------------------------------------------------------

INPUT_CASES = {
    "float tokens": (torch.zeros(2, 3), None),
    "bool tokens": (torch.ones(2, 3, dtype=torch.bool), None),
    "rank 1": (torch.zeros(3, dtype=torch.long), None),
    "rank 3": (torch.zeros(1, 2, 3, dtype=torch.long), None),
    "int mask": (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)),
    "mask shape": (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)),
    "id too large": (torch.full((2, 3), VOCAB, dtype=torch.long), None),
    "negative id": (torch.full((2, 3), -1, dtype=torch.long), None),
    "empty row": (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool)),
    "too long": (torch.zeros(1, 21, dtype=torch.long), None),
    "empty": (torch.zeros(0, 3, dtype=torch.long), None),
    "numpy": (torch.zeros(2, 3, dtype=torch.long).numpy(), None),
}


@pytest.fixture(scope="module")
def loaded(artefacts):
    return {fmt: reader.load(path) for fmt, path in artefacts.items()}


@pytest.mark.parametrize("fmt", ["folder", "pt2", "onnx"])
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_wrappers_refuse_bad_inputs(loaded, fmt, case):
    tokens, mask = INPUT_CASES[case]
    wrong_type = case in ("float tokens", "bool tokens", "int mask", "numpy")  # TypeError; the rest ValueError
    with pytest.raises(TypeError if wrong_type else ValueError):
        loaded[fmt](tokens, mask)


@HYPOTHESIS
@given(
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    low=st.integers(-3, VOCAB),
    masked=st.booleans(),
)
def test_wrappers_answer_any_input_with_logits_or_value_error(loaded, model, dtype, shape, low, masked):
    """Oracle: the source model's logits where the input is valid, else TypeError (a float
    or bool dtype) or ValueError."""
    tokens = torch.full(shape, low).to(dtype)
    mask = (torch.rand(shape) > 0.3) if masked else None
    for fmt in ("pt2", "onnx"):
        try:
            found = loaded[fmt](tokens, mask)
        except TypeError:
            assert dtype in (torch.float32, torch.bool)
            continue
        except ValueError:
            continue
        with torch.no_grad():
            expected = expected_logits(model, tokens, mask)
        assert torch.allclose(found, expected, atol=1e-5)


# ---- structure-aware damage: any JSON value replaced by any other ------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def json_paths(node, path=()):
    yield path
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from json_paths(child, (*path, key))


def replaced(node, path, value):
    if not path:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[path[0]] = replaced(node[path[0]], path[1:], value)
    return copy


@HYPOTHESIS
@given(
    which=st.sampled_from(["weights_config.json", "constants_config.json", "probformer.json", "models/model.json"]),
    index=st.integers(0, 10**6),
    value=JSON_VALUES,
)
def test_any_json_value_of_a_pt2_replaced_is_refused_or_unchanged(tmp_path, artefacts, model, which, index, value):
    entries = entries_of(artefacts["pt2"])
    name = key(entries, which)
    document = json.loads(entries[name])
    paths = list(json_paths(document))
    entries[name] = json.dumps(replaced(document, paths[index % len(paths)], value)).encode()
    outcome(write_torch_archive(tmp_path / "edited.pt2", entries), model)


@HYPOTHESIS
@given(index=st.integers(0, 10**6), value=JSON_VALUES)
def test_any_json_value_of_a_folder_config_replaced_is_refused_or_unchanged(tmp_path, artefacts, model, index, value):
    folder = tmp_path / "edited"
    if not folder.exists():
        write_folder(folder, model=model)
    document = json.loads((artefacts["folder"] / "config.json").read_text())
    paths = list(json_paths(document))
    (folder / "config.json").write_text(json.dumps(replaced(document, paths[index % len(paths)], value)))
    try:
        outcome(folder, model)
    except AssertionError:  # a changed config value that builds the same shapes (dropout, norm...) may differ
        pass
