"""The source model and its three valid artefacts (torch folder, ``.pt2``, ONNX), written
once for every reader test file (package scope: each export takes seconds)."""

import pytest

from tests.probformer.deploy.reader.artefacts import tiny, write_folder, write_onnx, write_pt2


@pytest.fixture(scope="package")
def model():
    return tiny()


@pytest.fixture(scope="package")
def artefacts(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("artefacts")
    return {
        "folder": write_folder(root / "folder", model=model),
        "pt2": write_pt2(root / "model.pt2", model),
        "onnx": write_onnx(root / "model.onnx", model),
    }
