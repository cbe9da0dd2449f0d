"""save_pretrained / from_pretrained and the config aliases.

Oracles: the source model's own logits and config (a loaded model must give the same
logits bit for bit), the folder's files read here with ``json`` and ``safetensors``
(never through probformer), folders written here by hand, and the alias table of
docs/models.md restated below. Crafted folders (missing files, wrong shapes, unknown
tensors, a live pickle, NaN weights) must be refused with the named exception.
"""

import dataclasses
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import probformer
from probformer.models import pretrained, registry
from probformer.models.pretrained import PretrainedMixin
from probformer.training.run_config import RunConfig

torch.set_num_threads(1)


VOCAB = 30


CONFIGS = {
    "probabilistic_transformer": dict(vocab_size=VOCAB, labels=8, channels=2, rank=3, global_labels=2, iterations=2),
    "particle_transformer": dict(vocab_size=VOCAB, width=8, heads=2, layers=2, ffn_width=16, max_length=12),
    "transformer": dict(vocab_size=VOCAB, width=8, heads=2, layers=2, ffn_width=16, max_length=12),
    "swarmformer": dict(vocab_size=VOCAB, width=8, heads=2, layers=1, ffn_width=16, clusters=2, max_length=12),
    "folded_context": dict(
        vocab_size=VOCAB, width=8, heads=2, local_layers=1, global_layers=1, ffn_width=16, segment=4
    ),
}


# docs/models.md's table: for each kind, alias -> the canonical key it stands for
ALIASES = {
    "probabilistic_transformer": {"hidden_size": "labels", "num_heads": "channels", "head_dim": "rank"}
    | {"num_layers": "iterations"},
    "particle_transformer": {"hidden_size": "width", "num_heads": "heads", "num_layers": "layers"}
    | {"intermediate_size": "ffn_width"},
    "transformer": {"hidden_size": "width", "num_heads": "heads", "num_layers": "layers"}
    | {"intermediate_size": "ffn_width"},
    "swarmformer": {"hidden_size": "width", "num_heads": "heads", "num_layers": "layers"}
    | {"intermediate_size": "ffn_width"},
    "folded_context": {"hidden_size": "width", "num_heads": "heads", "intermediate_size": "ffn_width"},
}


KINDS = sorted(CONFIGS)


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return registry.build(kind, CONFIGS[kind]).eval()


def batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 8), generator=generator)
    mask = torch.arange(8)[None, :] < torch.tensor([8, 5, 1])[:, None]
    return tokens, mask


def logits(model):
    with torch.no_grad():
        return model(*batch())[0]


def stored_once(model) -> dict[str, torch.Tensor]:
    """The state dict with each tensor shared under several names (the PT's ``crf`` and
    ``mean_field.crf``) under its first name only."""
    first = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), (name, tensor))
    return {name: tensor.detach() for name, tensor in first.values()}


def write_by_hand(folder: Path, kind: str, config: dict, weights: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    record = {"format": "probformer-torch/2", "model": kind, "config": config}
    (folder / "config.json").write_text(json.dumps(record))
    return folder


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_gives_the_same_logits_config_and_files(tmp_path, kind):
    model = tiny(kind)
    folder = pretrained.save_pretrained(model, tmp_path / "saved")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    record = json.loads((folder / "config.json").read_text())
    assert record == {"format": "probformer-torch/2", "model": kind, "config": dataclasses.asdict(model.config)}
    expected = stored_once(model)
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert sorted(weights.keys()) == sorted(expected)
        for name in expected:
            assert torch.equal(weights.get_tensor(name), expected[name])
    loaded = pretrained.from_pretrained(folder)
    assert type(loaded) is type(model) and not loaded.training
    assert loaded.config == model.config
    assert torch.equal(logits(loaded), logits(model))
    assert all(p.requires_grad for p in loaded.parameters())  # trainable, unlike probformer.load's view


@pytest.mark.parametrize("kind", KINDS)
def test_methods_round_trip(tmp_path, kind):
    _, model_cls = registry.classes(kind)
    if not issubclass(model_cls, PretrainedMixin):
        pytest.skip(f"{model_cls.__name__} does not inherit PretrainedMixin yet (/tmp/helpers/h4_particle.txt)")
    model = tiny(kind, seed=3)
    model.save_pretrained(tmp_path / "saved")
    loaded = model_cls.from_pretrained(tmp_path / "saved")
    assert loaded.config == model.config and torch.equal(logits(loaded), logits(model))


def test_a_class_refuses_a_folder_of_another_kind(tmp_path):
    from probformer.models.baselines import Transformer

    pretrained.save_pretrained(tiny("probabilistic_transformer"), tmp_path / "pt")
    with pytest.raises(ValueError, match="'probabilistic_transformer' model, not a 'transformer'"):
        Transformer.from_pretrained(tmp_path / "pt")


def test_export_and_save_pretrained_write_one_format(tmp_path):
    from probformer.models.probabilistic_transformer import ProbabilisticTransformer

    model = tiny("probabilistic_transformer")
    probformer.export(model, tmp_path / "exported", format="torch")
    model.save_pretrained(tmp_path / "saved")
    records = [json.loads((tmp_path / folder / "config.json").read_text()) for folder in ("exported", "saved")]
    assert records[0] == records[1]
    assert torch.equal(logits(ProbabilisticTransformer.from_pretrained(tmp_path / "exported")), logits(model))
    assert torch.equal(probformer.load(tmp_path / "saved")(*batch()), logits(model))


def test_a_folder_written_by_hand_loads_its_values(tmp_path):
    """Every stored value lands in its parameter: weights i * 1e-3 (shapes from the model)."""
    model = tiny("transformer")
    weights = {
        name: torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) * 1e-3 if t.is_floating_point() else t
        for name, t in stored_once(model).items()
    }
    write_by_hand(tmp_path / "hand", "transformer", CONFIGS["transformer"], weights)
    loaded = pretrained.from_pretrained(tmp_path / "hand")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[name])


def test_bf16_weights_load_in_bf16_and_map_location_is_honoured(tmp_path):
    model = tiny("transformer").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    loaded = pretrained.from_pretrained(tmp_path / "bf16")
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    on_meta = pretrained.from_pretrained(tmp_path / "bf16", map_location="meta")
    assert all(p.device.type == "meta" for p in on_meta.parameters())


def test_a_hub_repo_is_read_from_the_cache_without_the_network(tmp_path):
    """``owner/name`` with ``local_files_only``: huggingface_hub's cache layout (snapshot
    files are symlinks into blobs/), made here by hand."""
    model = tiny("swarmformer")
    source = pretrained.save_pretrained(model, tmp_path / "source")
    repo = tmp_path / "cache" / "models--someone--tiny-swarm"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in ("config.json", "model.safetensors"):
        blob = repo / "blobs" / f"blob-{name}"
        blob.write_bytes((source / name).read_bytes())
        os.symlink(blob, repo / "snapshots" / commit / name)
    options = {"cache_dir": tmp_path / "cache", "local_files_only": True}
    loaded = pretrained.from_pretrained("someone/tiny-swarm", **options)
    assert torch.equal(logits(loaded), logits(model))
    with pytest.raises(FileNotFoundError, match="someone/absent"):
        pretrained.from_pretrained("someone/absent", **options)


# ---- refusals ------------------------------------------------------------------------------


def test_missing_paths_and_files_are_refused(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no saved model"):
        pretrained.from_pretrained(tmp_path / "nothing")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="no saved model at runs/missing"):  # local: "runs" is a folder here
        pretrained.from_pretrained("runs/missing")
    folder = pretrained.save_pretrained(tiny("transformer"), tmp_path / "saved")
    with pytest.raises(ValueError, match="is a file"):
        pretrained.from_pretrained(folder / "config.json")
    for name in ("model.safetensors", "config.json"):
        (folder / name).unlink()
        with pytest.raises(FileNotFoundError, match=f"{name} is missing"):
            pretrained.from_pretrained(folder)


def test_wrong_shapes_unknown_and_missing_tensors_are_refused(tmp_path):
    weights = stored_once(tiny("transformer"))
    narrower = {**CONFIGS["transformer"], "width": 4, "ffn_width": 8}
    cases = {
        "shape mismatch": (narrower, weights),  # the config asks for other shapes than the file has
        "tensors the model does not have": (CONFIGS["transformer"], {**weights, "evil.weight": torch.ones(2)}),
        "'head.decoder.bias' is missing": (
            CONFIGS["transformer"],
            {k: v for k, v in weights.items() if k != "head.decoder.bias"},
        ),
    }
    for i, (message, (config, stored)) in enumerate(cases.items()):
        folder = write_by_hand(tmp_path / f"case{i}", "transformer", config, stored)
        with pytest.raises(ValueError, match=message):
            pretrained.from_pretrained(folder)


def test_a_config_larger_than_its_weights_is_refused_before_allocating(tmp_path):
    weights = stored_once(tiny("transformer"))
    huge = {**CONFIGS["transformer"], "vocab_size": 2**20, "width": 512, "heads": 2}
    folder = write_by_hand(tmp_path / "huge", "transformer", huge, weights)
    with pytest.raises(ValueError, match="needs at least .* bytes of weights"):
        pretrained.from_pretrained(folder)


def test_unknown_config_keys_and_records_are_refused(tmp_path):
    weights = stored_once(tiny("transformer"))
    folder = write_by_hand(tmp_path / "keys", "transformer", {**CONFIGS["transformer"], "evil": 1}, weights)
    with pytest.raises(ValueError, match="bad model config: unknown config keys"):
        pretrained.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model": "transformer", "config": CONFIGS["transformer"]}))
    with pytest.raises(ValueError, match="must have keys"):
        pretrained.from_pretrained(folder)


@pytest.mark.parametrize("weight", ["-inf", "nan", "1e400", True])
def test_a_weight_that_is_not_a_number_in_config_json_is_refused_naming_it(tmp_path, weight):
    """A hand-edited ``"weights": {"head": "-inf"}`` gave NaN logits once loaded: the load
    now refuses it, naming the key."""
    folder = pretrained.save_pretrained(tiny("probabilistic_transformer"), tmp_path / "saved")
    record = json.loads((folder / "config.json").read_text())
    record["config"]["weights"] = {"head": weight}
    (folder / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="bad model config: config key 'weights.head' must be"):
        probformer.load(folder)


@pytest.mark.parametrize("where", ["record", "config"])
def test_a_key_given_twice_in_config_json_is_refused(tmp_path, where):
    """JSON readers disagree on which of two values wins: the file means two things."""
    folder = tmp_path / "twice"
    pretrained.save_pretrained(tiny("transformer"), folder)
    text = (folder / "config.json").read_text()
    if where == "record":
        text = text.replace('"model": "transformer"', '"model": "transformer", "model": "transformer"', 1)
    else:
        text = text.replace('"width": ', '"width": 8, "width": ', 1)
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config.json gives a key more than once in one object \(1 repeats\)"):
        pretrained.from_pretrained(folder)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    for bad in (float("nan"), float("inf")):
        weights = stored_once(tiny("transformer"))
        weights["embedding.weight"] = weights["embedding.weight"].clone()
        weights["embedding.weight"][3, 1] = bad
        folder = write_by_hand(tmp_path / str(bad), "transformer", CONFIGS["transformer"], weights)
        with pytest.raises(ValueError, match="'embedding.weight' holds NaN or infinite"):
            pretrained.from_pretrained(folder)


class _Payload:
    """Unpickling it creates a marker file: the proof that a loader ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_in_the_folder_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    folder = pretrained.save_pretrained(tiny("transformer"), tmp_path / "saved")
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    pickle.loads((folder / "pytorch_model.bin").read_bytes())
    assert marker.exists()  # the file is live: plain pickle runs it
    marker.unlink()
    with pytest.raises(ValueError, match="unexpected 'pytorch_model.bin'"):
        pretrained.from_pretrained(folder)
    with pytest.raises(FileExistsError, match="pytorch_model.bin"):  # nor does save_pretrained write beside it
        pretrained.save_pretrained(tiny("transformer"), folder)
    assert not marker.exists()


def test_a_symlinked_weights_file_is_refused(tmp_path):
    folder = pretrained.save_pretrained(tiny("transformer"), tmp_path / "saved")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", folder / "model.safetensors")
    with pytest.raises(ValueError, match="symlink"):
        pretrained.from_pretrained(folder)


def test_save_pretrained_refuses_a_foreign_module_and_overwrites_its_own_folder(tmp_path):
    with pytest.raises(ValueError, match="not a probformer model"):
        pretrained.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    broken = tiny("transformer")
    with torch.no_grad():
        broken.position.weight[2, 0] = float("nan")
    with pytest.raises(ValueError, match="'position.weight' holds NaN"):
        pretrained.save_pretrained(broken, tmp_path / "broken")
    assert not (tmp_path / "broken").exists()
    first, second = tiny("transformer", seed=0), tiny("transformer", seed=1)
    pretrained.save_pretrained(first, tmp_path / "saved")
    pretrained.save_pretrained(second, tmp_path / "saved")
    assert torch.equal(logits(pretrained.from_pretrained(tmp_path / "saved")), logits(second))


# ---- aliases -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_has_the_documented_aliases(kind):
    config_cls, _ = registry.classes(kind)
    assert config_cls.aliases() == ALIASES[kind]


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_alias_configs_equal_canonical_configs(kind, data):
    config_cls, _ = registry.classes(kind)
    canonical = CONFIGS[kind]
    renamed = data.draw(st.sets(st.sampled_from(sorted(ALIASES[kind]))))
    by_alias = {k: v for k, v in canonical.items() if k not in {ALIASES[kind][a] for a in renamed}}
    by_alias |= {alias: canonical[ALIASES[kind][alias]] for alias in renamed}
    expected = config_cls(**canonical)
    for config in (config_cls(**by_alias), config_cls.from_dict(by_alias)):
        assert config == expected
        assert config.to_dict() == dataclasses.asdict(expected) and not set(config.to_dict()) & set(ALIASES[kind])
        for alias, key in ALIASES[kind].items():
            assert getattr(config, alias) == canonical[key]


@pytest.mark.parametrize("kind", KINDS)
def test_an_alias_with_its_canonical_key_is_refused_naming_both(kind):
    config_cls, _ = registry.classes(kind)
    for alias, key in ALIASES[kind].items():
        values = {**CONFIGS[kind], alias: CONFIGS[kind][key]}
        for build in (config_cls.from_dict, lambda values: config_cls(**values)):
            with pytest.raises(ValueError, match="name the same setting") as error:
                build(values)
            assert alias in str(error.value) and key in str(error.value)


def test_alias_attribute_writes_the_canonical_key_and_foreign_aliases_are_unknown():
    from probformer.models.baselines import TransformerConfig
    from probformer.models.probabilistic_transformer import PTConfig

    config = PTConfig(vocab_size=VOCAB)
    config.hidden_size = 24
    assert config.labels == 24 and "hidden_size" not in vars(config)
    with pytest.raises(ValueError, match=r"unknown config keys \['head_dim'\]"):
        TransformerConfig.from_dict({"vocab_size": VOCAB, "head_dim": 4})
    with pytest.raises(TypeError, match="'hidden_size' must be of type int"):
        PTConfig.from_dict({"vocab_size": VOCAB, "hidden_size": "24"})


def test_a_run_config_takes_the_aliases():
    aliased = {"kind": "probabilistic_transformer", "hidden_size": 8, "num_heads": 2, "head_dim": 3, "num_layers": 2}
    canonical = {"kind": "probabilistic_transformer", "labels": 8, "channels": 2, "rank": 3, "iterations": 2}
    build = [RunConfig.from_dict({"model": model}).model_config(vocab_size=VOCAB) for model in (aliased, canonical)]
    assert build[0] == build[1]
