"""Damage to valid artefacts, made by hypothesis: byte flips and truncations of each format,
and any JSON value of a ``.pt2`` or a folder's config replaced by any other, end in
``ValueError`` / ``FileNotFoundError`` or in a model that still computes the source model's
logits (ONNX and safetensors have no checksum: there, logits of the right shape and finite),
never in another exception."""

import json

import torch
from hypothesis import given
from hypothesis import strategies as st

from probformer.deploy import reader
from tests.probformer.deploy.reader.artefacts import HYPOTHESIS, VOCAB, batch, expected_logits, write_folder
from tests.probformer.deploy.reader.crafting import entries_of, key, write_torch_archive

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


# ---- structure-aware damage: any JSON value replaced by any other ------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def json_paths(node, path=()):
    yield path
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:  # noqa: F402 (shadows crafting.key here, as it did beside it)
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
