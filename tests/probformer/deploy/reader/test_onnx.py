"""ONNX: self-contained files only. External data is refused wherever it sits (outside the
folder, inside it, or in a sparse tensor of a Constant node), and a file without the
probformer record or with another signature is refused."""

from tests.probformer.deploy.reader.artefacts import assert_refused


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
