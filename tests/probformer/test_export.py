"""Export (issue 8): every format reproduces the source model (oracle: the trainable
model itself, in eval mode) on padded batches of several lengths; the "torch" artefact
runs with pyro, numpyro, jax, arviz, networkx (and probformer) unimportable; files that
are not what they claim are refused with a clear error."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import graphs
import probformer
from probformer import cli
from probformer.deploy import exporter as deploy
from probformer.models import blocks as runtime
from probformer.models.baselines import Transformer, TransformerConfig
from probformer.training import checkpoint, data

torch.set_num_threads(1)
VOCAB = 40
TOLERANCE = 1e-5


def pt(topology="full", mup=False, schedule="async", **overrides):
    config = dict(vocab_size=VOCAB, labels=12, channels=2, rank=3, global_labels=3, gamma=1, iterations=2)
    config.update(topology=topology, schedule=schedule, mup=mup, mup_base_width=6 if mup else 0, **overrides)
    torch.manual_seed(0)
    return probformer.ProbabilisticTransformer(probformer.PTConfig(**config)).eval()


def particle():
    torch.manual_seed(0)
    config = probformer.ParticleConfig(
        vocab_size=VOCAB, width=16, heads=2, layers=3, ffn_width=32, max_length=20, resample_every=1, ess_threshold=0.9
    )
    return probformer.ParticleTransformer(config).eval()


def transformer(norm="pre", universal=False):
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32, max_length=20, norm=norm, universal=universal
    )
    return Transformer(config).eval()


def batches(seed=0):
    """Random batches of several shapes; every row but the first is padded at random."""
    generator = torch.Generator().manual_seed(seed)
    for size, length in [(1, 1), (3, 6), (4, 13), (2, 20)]:
        tokens = torch.randint(0, VOCAB, (size, length), generator=generator)
        lengths = torch.randint(1, length + 1, (size,), generator=generator)
        lengths[0] = length
        yield tokens, torch.arange(length)[None, :] < lengths[:, None]


def assert_reproduces(model, artefact):
    for tokens, mask in batches():
        with torch.no_grad():
            expected, found = model(tokens, mask)[0], artefact(tokens, mask)
        assert found.shape == expected.shape and found.dtype == expected.dtype
        assert (found - expected).abs().max().item() <= TOLERANCE


# ---- the runtime's topology rules ------------------------------------------------

TERMS = st.sampled_from(
    ["full()", "causal()", "window(1)", "window(3)", "star()", "star(wrap=True)", "root()", "clusters(1)"]
    + ["clusters(3)", "segments(2)", "segments(5)", "clusters(2, dynamic=True)", "segments(3, causal=True)"]
)


@settings(max_examples=60, deadline=None)
@given(st.lists(TERMS, min_size=1, max_size=3), st.integers(1, 17), st.integers(0, 3))
def test_runtime_topologies_and_groups_equal_graphs(terms, n, gamma):
    topology = graphs.topology.parse(" | ".join(terms))
    assert torch.equal(runtime.topology_mask(topology.name, n), topology.mask(n))
    assert runtime.topology_extra_nodes(topology.name) == topology.extra_nodes
    groups = graphs.crf.distance_groups(n, gamma, topology.extra_nodes)
    found = runtime.distance_groups(n, gamma, topology.extra_nodes)
    off_diagonal = ~torch.eye(len(groups), dtype=torch.bool)  # the diagonal is never an arc
    assert torch.equal(found[off_diagonal], groups[off_diagonal])


# ---- every format reproduces the source ---------------------------------------------

TORCH_CASES = {
    "pt-full": lambda: pt(),
    "pt-full-mup": lambda: pt(mup=True),
    "pt-causal-parallel": lambda: pt("causal", schedule="parallel"),
    "pt-window-star-mup": lambda: pt("window(2) | star(wrap=True)", mup=True),
    "pt-clusters-segments": lambda: pt("segments(4) | clusters(3)"),
    "pt-root-classification": lambda: pt("full | root()", task="classification", num_classes=5, pooling="root"),
    "pt-tagging-no-globals": lambda: pt("window(1)", task="tagging", num_classes=4, global_labels=0),
    "particle": particle,
    "transformer-pre": transformer,
    "transformer-post-universal": lambda: transformer("post", universal=True),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_torch_format_reproduces_the_model(tmp_path, case):
    model = TORCH_CASES[case]()
    path = probformer.export(model, tmp_path / "model", format="torch")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", deploy.RUNTIME_FILE]
    assert_reproduces(model, probformer.load(path))


@pytest.mark.parametrize(
    "case, format",
    [
        ("pt-window-star-mup", "exported"),
        ("pt-window-star-mup", "onnx"),
        ("pt-causal-parallel", "exported"),
        ("particle", "exported"),
        ("particle", "onnx"),
        ("transformer-post-universal", "onnx"),
    ],
)
def test_traced_formats_reproduce_the_model_at_every_shape(tmp_path, case, format):
    model = TORCH_CASES[case]()
    path = probformer.export(model, tmp_path / ("model.pt2" if format == "exported" else "model.onnx"), format)
    assert_reproduces(model, probformer.load(path))  # traced at [2, 5]: batch and length are dynamic


def test_export_accepts_an_example_and_a_checkpoint_with_its_vocabulary(tmp_path):
    model = pt("window(2)")
    vocabulary = data.Vocabulary.build([[f"w{i}" for i in range(VOCAB - 3)]])
    assert len(vocabulary) == VOCAB
    checkpoint.save(model, tmp_path / "checkpoint", vocabulary)
    tokens = torch.randint(0, VOCAB, (2, 7))
    path = probformer.export(tmp_path / "checkpoint", tmp_path / "out", example=tokens)
    assert json.loads((path / "vocabulary.json").read_text()) == vocabulary.words
    assert_reproduces(model, probformer.load(path))


def test_bf16_model_exports_in_bf16(tmp_path):
    model = pt("window(2)").to(torch.bfloat16)
    artefact = probformer.load(probformer.export(model, tmp_path / "model"))
    assert_reproduces(model, artefact)  # same dtype, same values


def test_cli_export(tmp_path, capsys):
    model = particle()
    checkpoint.save(model, tmp_path / "checkpoint")
    assert (
        cli.main(["export", str(tmp_path / "checkpoint"), "--format", "exported", "--out", str(tmp_path / "m.pt2")])
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    assert_reproduces(model, probformer.load(tmp_path / "m.pt2"))


# ---- the torch artefact needs only torch ---------------------------------------------

BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked in this test")
sys.meta_path.insert(0, Blocker())
"""

RUN = """
import torch
from safetensors.torch import load_file
io = load_file({io!r})
model = {loader}
found = model(io["tokens"], io["mask"].bool())
assert (found - io["expected"]).abs().max().item() <= 1e-5, "outputs differ"
heavy = sorted({{"pyro", "numpyro", "jax", "arviz", "networkx"}} & {{m.split(".")[0] for m in sys.modules}})
assert not heavy, heavy
print("ran without", {blocked!r})
"""


@pytest.mark.parametrize(
    "loader, blocked",
    [
        # the artefact alone: its own loader file, probformer itself unimportable
        (
            "__import__('probformer_runtime').load({path!r})",
            ["pyro", "numpyro", "jax", "arviz", "networkx", "probformer"],
        ),
        # through the installed package: probformer.load imports no heavy dependency
        ("__import__('probformer').load({path!r})", ["pyro", "numpyro", "jax", "arviz", "networkx"]),
    ],
)
def test_torch_artefact_runs_where_the_ppl_stack_cannot_be_imported(tmp_path, loader, blocked):
    model = pt("window(2) | star()", mup=True)
    path = probformer.export(model, tmp_path / "model")
    tokens, mask = list(batches())[2]
    with torch.no_grad():
        expected = model(tokens, mask)[0]
    save_file({"tokens": tokens, "mask": mask.to(torch.uint8), "expected": expected}, str(tmp_path / "io.safetensors"))
    script = BLOCKER.format(blocked=blocked) + RUN.format(
        io=str(tmp_path / "io.safetensors"), loader=loader.format(path=str(path)), blocked=blocked
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(path), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ran without" in result.stdout


# ---- files that are not what they claim -------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exports")
    model = particle()
    return {
        "torch": probformer.export(model, folder / "model"),
        "exported": probformer.export(model, folder / "model.pt2", "exported"),
        "onnx": probformer.export(model, folder / "model.onnx", "onnx"),
    }


def copy(source: Path, target: Path) -> Path:
    if source.is_dir():
        target.mkdir()
        for file in source.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
    else:
        target.write_bytes(source.read_bytes())
    return target


def edit_config(folder: Path, edit) -> None:
    meta = json.loads((folder / "config.json").read_text())
    edit(meta)
    (folder / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:100]), "safetensors"),
        (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda f: (f / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda f: edit_config(f, lambda m: m.update(format="probformer-checkpoint/1")), "format must be"),
        (lambda f: edit_config(f, lambda m: m.update(model="gpt")), "unknown model"),
        (lambda f: edit_config(f, lambda m: m["config"].pop("heads")), "lacks keys ['heads']"),
        (lambda f: edit_config(f, lambda m: m["config"].update(width=32, heads=2)), "shape mismatch"),
        (lambda f: edit_config(f, lambda m: m["config"].update(layers=4)), "missing keys"),
        (lambda f: edit_config(f, lambda m: m["config"].update(task="translation")), "bad config value"),
    ],
)
def test_damaged_torch_exports_are_refused(exported, tmp_path, damage, message):
    folder = copy(exported["torch"], tmp_path / "damaged")
    damage(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("[", r"\[").replace("]", r"\]")):
        probformer.load(folder)


def rewrite_pt2(source: Path, target: Path, change) -> Path:
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            new.writestr(item, change(item.filename, old.read(item.filename)))
    return target


def pickled_weights(name: str, content: bytes) -> bytes:
    if not name.endswith("weights_config.json"):
        return content
    config = json.loads(content)
    for entry in config["config"].values():
        entry["use_pickle"] = True
    return json.dumps(config).encode()


def test_damaged_and_foreign_files_are_refused(exported, tmp_path):
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(exported["exported"].read_bytes()[:-4000])
    with pytest.raises(ValueError, match="not a readable .pt2 archive|torch.export cannot read|foreign or damaged"):
        probformer.load(truncated)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        probformer.load(rewrite_pt2(exported["exported"], tmp_path / "pickle.pt2", pickled_weights))
    foreign = rewrite_pt2(
        exported["exported"], tmp_path / "foreign.pt2", lambda n, c: b"{}" if n.endswith("probformer.json") else c
    )
    with pytest.raises(ValueError, match="not a probformer torch.export file"):
        probformer.load(foreign)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(exported["onnx"].read_bytes()[:-3000])
    with pytest.raises(ValueError, match="valid ONNX"):
        probformer.load(broken)
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(ValueError, match="neither a probformer export nor a valid ONNX"):
        probformer.load(noise)
    with pytest.raises(FileNotFoundError, match="no exported model"):
        probformer.load(tmp_path / "nothing.onnx")


def test_foreign_onnx_is_refused(tmp_path):
    import onnx

    plain = tmp_path / "plain.onnx"
    torch.onnx.export(torch.nn.Linear(2, 2).eval(), (torch.ones(1, 2),), str(plain), dynamo=True, external_data=False)
    onnx.checker.check_model(onnx.load(str(plain)))
    with pytest.raises(ValueError, match="not a probformer export"):
        probformer.load(plain)


def test_bad_export_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="format must be one of"):
        probformer.export(pt(), tmp_path / "x", format="tflite")
    with pytest.raises(ValueError, match="cannot export a Linear"):
        probformer.export(torch.nn.Linear(2, 2), tmp_path / "x")
    with pytest.raises(ValueError, match="schedule 'sequential' cannot be exported"):
        probformer.export(pt(schedule="sequential"), tmp_path / "x")
    model = pt()
    model.crf.topology = graphs.topology.Topology("custom", (), lambda n: torch.ones(n, n, dtype=torch.bool))
    with pytest.raises(ValueError, match="topology 'custom' cannot be exported"):
        probformer.export(model, tmp_path / "x")
    with pytest.raises(ValueError, match="token ids must lie in"):
        probformer.export(pt(), tmp_path / "x", example=torch.tensor([[VOCAB]]))
    with pytest.raises(RuntimeError, match="differs from the source model"):  # a check that cannot pass
        probformer.export(pt(), tmp_path / "x", tolerance=-1.0)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing half-written


def test_loaded_models_check_their_inputs(exported):
    for path in exported.values():
        model = probformer.load(path)
        with pytest.raises(ValueError, match="token ids must lie in"):
            model(torch.tensor([[VOCAB]]))
        with pytest.raises(ValueError, match="at least one real token"):
            model(torch.tensor([[1, 2]]), torch.tensor([[False, False]]))
        with pytest.raises(ValueError, match="exceeds max_length"):
            model(torch.zeros(1, 21, dtype=torch.long))
