"""Loading a crafted file never runs code from it. The code-execution attacks on
``torch.export.load`` are rebuilt here from a real export: each test first shows that plain
torch runs the payload (it creates a marker file), then that ``probformer.deploy.reader.load``
refuses the same file with a ``ValueError`` (or loads it with the dangerous part dropped) and
the marker never appears; calls outside ATen and program JSON that torch would evaluate are
refused by the program check."""

import contextlib
import json
import logging
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from probformer.deploy import archive, reader
from tests.probformer.deploy.reader.artefacts import assert_refused, batch, expected_logits
from tests.probformer.deploy.reader.crafting import (
    Payload,
    entries_of,
    key,
    pickled,
    write_plain_zip,
    write_torch_archive,
)


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
