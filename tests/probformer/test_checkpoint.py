import json

import pytest
import torch

import probformer as pf
from probformer.training import checkpoint, data


def models():
    torch.manual_seed(0)
    yield pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=20, labels=8, channels=2, rank=2, iterations=2))
    yield pf.ParticleTransformer(pf.ParticleConfig(vocab_size=20, width=16, heads=2, layers=2, ffn_width=32))


@pytest.mark.parametrize("model", list(models()), ids=["pt", "particle"])
def test_round_trip_gives_equal_outputs(model, tmp_path):
    vocab = data.Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(17)])
    checkpoint.save(model, tmp_path, vocab)
    loaded, loaded_vocab = checkpoint.load(tmp_path)
    tokens = torch.randint(0, 20, (2, 7))
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0])
    assert loaded_vocab.words == vocab.words
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    model = next(models())
    checkpoint.save(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    content = weights.read_bytes()
    weights.write_bytes(content[: len(content) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        checkpoint.load(tmp_path)
    weights.write_bytes(content)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "format": "other"}))
    with pytest.raises(ValueError, match="format must be"):
        checkpoint.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**meta, "config": {**meta["config"], "labels": 9}}))
    with pytest.raises(ValueError, match="shape mismatch"):
        checkpoint.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        checkpoint.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        checkpoint.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="cannot checkpoint a Linear"):
        checkpoint.save(torch.nn.Linear(2, 2), tmp_path / "x")
