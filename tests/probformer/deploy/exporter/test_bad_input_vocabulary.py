"""``export``'s ``vocabulary`` is refused by name before anything is traced or written: an int,
a string or a list of words failed with an AttributeError while writing the folder."""

from __future__ import annotations

import pytest

import probformer
from probformer.training.data import Vocabulary
from tests.probformer.deploy.exporter.tiny_models import KINDS


@pytest.mark.parametrize("vocabulary", [5, "words", ["<pad>", "<unk>", "<mask>"], {"a": 1}, True])
def test_a_vocabulary_that_is_not_one_is_refused_by_name(vocabulary, tmp_path):
    model = KINDS["transformer"]()
    with pytest.raises(TypeError, match=r"vocabulary must be None or a Vocabulary or SubwordVocabulary"):
        probformer.export(model, tmp_path / "out", vocabulary=vocabulary)
    assert not (tmp_path / "out").exists()


def test_a_vocabulary_is_written_next_to_the_model(tmp_path):
    model = KINDS["transformer"]()
    words = ["<pad>", "<unk>", "<mask>", *[f"w{i}" for i in range(model.config.vocab_size - 3)]]
    path = probformer.export(model, tmp_path / "out", vocabulary=Vocabulary(words))
    assert (path / "vocabulary.json").exists()
