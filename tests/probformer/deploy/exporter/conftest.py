"""Every model kind in every format, exported once for all the export test files (package
scope: the traced formats take seconds each)."""

import pytest

import probformer
from tests.probformer.deploy.exporter.tiny_models import FILES, KINDS


@pytest.fixture(scope="package")
def every_export(tmp_path_factory):
    """Every model kind in every format, exported once for the tests below."""
    folder = tmp_path_factory.mktemp("every")
    models = {kind: make() for kind, make in KINDS.items()}
    paths = {
        (kind, format): probformer.export(model, folder / kind / name, format, max_length=20)
        for kind, model in models.items()
        for format, name in FILES.items()
    }
    return models, paths
