"""Export: every model kind in every format reproduces the source model (oracle: the
trainable model itself, in eval mode) on padded batches of several lengths; every
artefact runs where pyro, numpyro, jax, arviz and networkx cannot be imported; files
that are not what they claim are refused with a clear error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import graphs
import probformer
from probformer import cli
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


# ---- every kind, every format, one forward ----------------------------------------------


def swarm():
    torch.manual_seed(0)
    config = probformer.SwarmConfig(vocab_size=VOCAB, width=16, heads=2, layers=3, ffn_width=32, max_length=20)
    return probformer.SwarmFormer(config).eval()


def folded(folded=True):
    torch.manual_seed(0)
    config = probformer.FoldedContextConfig(
        vocab_size=VOCAB, width=16, heads=2, ffn_width=32, segment=4, local_layers=1, global_layers=1, folded=folded
    )
    return probformer.FoldedContext(config).eval()


KINDS = {
    # rank 16 over 12 labels: traced at the label rank (projections.at_label_rank); traced at a
    # rank below the labels: docs/export.md's snippets (4 over 16) and the slow variants below
    "probabilistic_transformer": lambda: pt("window(2) | star(wrap=True)", mup=True, rank=16),
    "particle_transformer": particle,
    "transformer": lambda: transformer("post", universal=True),
    "swarmformer": swarm,
    "folded_context": folded,
}


FILES = {"torch": "model", "exported": "model.pt2", "onnx": "model.onnx"}


@pytest.fixture(scope="module")
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


@pytest.mark.parametrize("format", sorted(FILES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_exports_to_every_format(every_export, kind, format):
    models, paths = every_export
    assert_reproduces(models[kind], probformer.load(paths[kind, format]))  # traced at [2, 5]: both dynamic


def test_the_torch_format_is_config_and_weights_only(every_export):
    _, paths = every_export
    for kind in KINDS:
        folder = paths[kind, "torch"]
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
        meta = json.loads((folder / "config.json").read_text())
        assert meta["model"] == kind and meta["format"] == "probformer-torch/2"


def test_the_torch_format_runs_the_model_itself(every_export):
    """No restatement: the loaded module is the trainable class, with the source's kernel."""
    models, paths = every_export
    for kind, model in models.items():
        loaded = probformer.load(paths[kind, "torch"]).model
        assert type(loaded) is type(model) and loaded.config == model.config


def test_swarmformer_with_contiguous_routing_exports_at_every_length(tmp_path):
    """Contiguous routing ties every confidence (every token writes its chunk): ONNX gives
    torch's logits at lengths past 16 (where the two backends sort ties differently)."""
    torch.manual_seed(0)
    config = probformer.SwarmConfig(
        vocab_size=VOCAB, width=16, heads=2, layers=3, ffn_width=32, max_length=40, routing="contiguous"
    )
    model = probformer.SwarmFormer(config).eval()
    artefact = probformer.load(probformer.export(model, tmp_path / "swarm.onnx", "onnx"))
    tokens = torch.randint(0, VOCAB, (2, 37))
    mask = torch.arange(37)[None, :] < torch.tensor([[37], [23]])
    with torch.no_grad():
        assert (artefact(tokens, mask) - model(tokens, mask)[0]).abs().max().item() <= TOLERANCE


@pytest.mark.slow  # three more traced exports; the folded model is in every_export
def test_folded_context_stream_and_windowed_baseline_export(tmp_path):
    model = folded(folded=False)
    for format, name in FILES.items():
        assert_reproduces(model, probformer.load(probformer.export(model, tmp_path / name, format, max_length=20)))


TOPOLOGIES = st.sampled_from(
    ["full()", "causal()", "window(1)", "window(3)", "star()", "star(wrap=True)", "root()", "clusters(1)"]
    + ["clusters(3)", "segments(2)", "segments(5)", "clusters(2, dynamic=True)", "segments(3, causal=True)"]
)


@settings(max_examples=12, deadline=None)
@given(st.lists(TOPOLOGIES, min_size=1, max_size=3), st.sampled_from(["low_rank", "cp", "tucker"]))
def test_pt_exports_on_every_topology_and_ternary_form(tmp_path_factory, terms, form):
    topology = " | ".join(terms)
    model = pt(topology, ternary_form=form, **({"ternary_blocks": 2} if form == "tucker" else {}))
    folder = tmp_path_factory.mktemp("topology")
    assert_reproduces(model, probformer.load(probformer.export(model, folder / "model")))


TORCH_CASES = {
    "pt-full": lambda: pt(),
    "pt-full-mup": lambda: pt(mup=True),
    "pt-causal-parallel": lambda: pt("causal", schedule="parallel"),
    "pt-clusters-segments": lambda: pt("segments(4) | clusters(3)"),
    "pt-root-classification": lambda: pt("full | root()", task="classification", num_classes=5, pooling="root"),
    "pt-tagging-no-globals": lambda: pt("window(1)", task="tagging", num_classes=4, global_labels=0),
    "pt-act": lambda: pt(halting="act", act_epsilon=0.1),
    "pt-span-product-key": lambda: pt(
        span=True, span_max=4, global_labels=4, global_memory="product_key", memory_topk=2
    ),
}


@pytest.mark.slow  # four more traced PT exports; every_export traces one PT in both formats
@pytest.mark.parametrize(
    "case, format",
    [
        ("pt-causal-parallel", "exported"),
        ("pt-clusters-segments", "onnx"),
        ("pt-root-classification", "exported"),
        ("pt-tagging-no-globals", "onnx"),
    ],
)
def test_traced_formats_reproduce_the_pt_variants(tmp_path, case, format):
    model = TORCH_CASES[case]()
    path = probformer.export(model, tmp_path / FILES[format], format)
    assert_reproduces(model, probformer.load(path))


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_torch_format_reproduces_every_pt_option(tmp_path, case):
    model = TORCH_CASES[case]()
    assert_reproduces(model, probformer.load(probformer.export(model, tmp_path / "model", format="torch")))


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "nowhere", "--out", "x"], "probformer export: error: nowhere is neither a checkpoint"),
        (["diagnose", "nowhere", "--data", "missing.txt", "--out", "d"], "probformer diagnose: error: "),
    ],
)
def test_cli_user_errors_are_one_line(tmp_path, argv, message):
    result = subprocess.run(
        [sys.executable, "-m", "probformer", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "d").exists()


# ---- exported models need only torch (and probformer's own torch code) -------------------

BLOCKER = """
import importlib.abc, importlib.machinery, sys
BLOCKED = {blocked!r}
class Absent(importlib.abc.Loader):  # as if not installed: find_spec finds no origin, import fails
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (blocked in this test)", name=spec.name)
    def exec_module(self, module):
        pass
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, Absent())
sys.meta_path.insert(0, Blocker())
"""


RUN = """
import json, torch
from safetensors.torch import load_file
import probformer
io = load_file({io!r})
for kind, paths in json.loads({paths!r}).items():
    expected = io[kind]
    for format, path in paths.items():
        found = probformer.load(path)(io["tokens"], io["mask"].bool())
        error = (found - expected).abs().max().item()
        assert error <= 1e-5, (kind, format, error)
        print("ran", kind, format)
heavy = sorted(set(BLOCKED) & {{m.split(".")[0] for m in sys.modules}})
assert not heavy, heavy
print("ran without", {blocked!r})
"""


@pytest.mark.parametrize(
    "formats, blocked",
    [
        (["torch", "onnx"], ["pyro", "numpyro", "jax", "arviz", "networkx", "xarray"]),
        # torch.export.load itself imports networkx (a dependency of torch, not of probformer)
        (["exported"], ["pyro", "numpyro", "jax", "arviz", "xarray"]),
    ],
)
def test_every_export_runs_where_the_research_stack_cannot_be_imported(every_export, tmp_path, formats, blocked):
    models, paths = every_export
    tokens, mask = list(batches())[2]
    io = {"tokens": tokens, "mask": mask.to(torch.uint8)}
    with torch.no_grad():
        io.update({kind: model(tokens, mask)[0].contiguous() for kind, model in models.items()})
    save_file(io, str(tmp_path / "io.safetensors"))
    layout = {kind: {format: str(paths[kind, format]) for format in formats} for kind in KINDS}
    script = BLOCKER.format(blocked=blocked) + RUN.format(
        io=str(tmp_path / "io.safetensors"), paths=json.dumps(layout), blocked=blocked
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ran ") == len(KINDS) * len(formats) + 1


# ---- files that are not what they claim -------------------------------------------------
# (crafted archives and code-execution attempts: tests/probformer/deploy/reader/)


@pytest.fixture(scope="module")
def exported(every_export):
    _, paths = every_export
    return {format: paths["particle_transformer", format] for format in FILES}


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
        (lambda f: edit_config(f, lambda m: m.update(format="probformer-torch/1")), "format must be"),
        (lambda f: edit_config(f, lambda m: m.update(model="gpt")), "unknown model"),
        (lambda f: edit_config(f, lambda m: m["config"].update(width=32, heads=2)), "shape|bytes"),
        (lambda f: edit_config(f, lambda m: m["config"].update(layers=4)), "missing|lacks"),
        (lambda f: edit_config(f, lambda m: m["config"].update(task="translation")), "task"),
        (lambda f: (f / "probformer_runtime.py").write_text("print('hello')"), "unexpected"),
    ],
)
def test_damaged_torch_exports_are_refused(exported, tmp_path, damage, message):
    folder = copy(exported["torch"], tmp_path / "damaged")
    damage(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        probformer.load(folder)


def test_damaged_and_foreign_files_are_refused(exported, tmp_path):
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(exported["exported"].read_bytes()[:-4000])
    with pytest.raises(ValueError, match="truncated.pt2"):
        probformer.load(truncated)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(exported["onnx"].read_bytes()[:-3000])
    with pytest.raises(ValueError, match="broken.onnx"):
        probformer.load(broken)
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(ValueError, match="noise.bin"):
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
    with pytest.raises(ValueError, match="not a probformer model: Linear"):
        probformer.export(torch.nn.Linear(2, 2), tmp_path / "x")
    for format in ("exported", "onnx"):  # values decide the number of iterations: no fixed graph
        with pytest.raises(ValueError, match="halting='act' or 'exit'.*format='torch'"):
            probformer.export(pt(halting="exit"), tmp_path / "x", format=format)
        with pytest.raises(ValueError, match="schedule='sequential'"):
            probformer.export(pt(schedule="sequential"), tmp_path / "x", format=format)
    with pytest.raises(ValueError, match="span=True"):
        probformer.export(pt(span=True), tmp_path / "x", format="onnx")
    model = pt()
    model.crf.topology = graphs.topology.Topology("custom", (), lambda n: torch.ones(n, n, dtype=torch.bool))
    with pytest.raises(ValueError, match="topology 'custom' is not the config's"):
        probformer.export(model, tmp_path / "x")
    with pytest.raises(ValueError, match="token ids must lie in"):
        probformer.export(pt(), tmp_path / "x", example=torch.tensor([[VOCAB]]))
    with pytest.raises(ValueError, match="max_length must be an integer"):
        probformer.export(pt(), tmp_path / "x", max_length=0)
    with pytest.raises(TypeError, match="max_length must be an integer"):
        probformer.export(pt(), tmp_path / "x", max_length=2.0)
    for tolerance in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
            probformer.export(pt(), tmp_path / "x", tolerance=tolerance)
    for tolerance in ("0.1", True):
        with pytest.raises(TypeError, match="tolerance must be a finite number >= 0"):
            probformer.export(pt(), tmp_path / "x", tolerance=tolerance)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing half-written


def test_an_export_that_differs_from_its_source_is_not_written(tmp_path, monkeypatch):
    from probformer.deploy import exporter

    model = transformer()
    wrong = lambda path: lambda tokens, mask: model(tokens, mask)[0] + 1e-3  # noqa: E731
    monkeypatch.setattr(exporter, "load", wrong)
    with pytest.raises(RuntimeError, match="differs from the source model by 0.001"):
        probformer.export(model, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_export_replaces_an_earlier_export_and_nothing_else(tmp_path):
    model = transformer()
    for name, format in (("model", "torch"), ("model.pt2", "exported")):
        path = probformer.export(model, tmp_path / name, format)
        assert probformer.export(model, path, format) == path  # an earlier export is replaced
    notes, folder = tmp_path / "notes.onnx", tmp_path / "mine"
    notes.write_text("my notes")
    folder.mkdir()
    (folder / "data.txt").write_text("keep")
    for target, format in ((notes, "onnx"), (folder, "torch"), (folder, "exported")):
        with pytest.raises(FileExistsError, match="is not a probformer export"):
            probformer.export(model, target, format)
    assert notes.read_text() == "my notes" and (folder / "data.txt").read_text() == "keep"


def test_export_never_replaces_a_training_checkpoint_or_a_runs_model(tmp_path, capsys):
    """A checkpoint and a run's model/ are the export's folder format with more in them (the
    training state, the tags), or with the same file names: export refuses both and leaves
    every byte as it was."""
    from probformer.training import run_checkpoints

    model = transformer()
    vocabulary = data.Vocabulary.build([[f"w{i}" for i in range(VOCAB - 3)]])
    run = tmp_path / "run"
    optimizer = torch.optim.AdamW(model.parameters())
    step = run_checkpoints.save_training_checkpoint(run, 2, model, optimizer, vocabulary, {"step": 2})
    run_checkpoints.save_final_model(run, model, vocabulary, ["NOUN", "VERB"])
    plain = run_checkpoints.save_final_model(tmp_path / "plain", model, vocabulary, None)  # the export's file names
    before = {p: p.read_bytes() for folder in (step, run / "model", plain) for p in folder.iterdir()}
    for target in (step, run / "model", plain):
        with pytest.raises(FileExistsError, match="is not a probformer export"):
            probformer.export(model, target)
        assert cli.main(["export", str(run), "--out", str(target)]) == 2
        assert "is not a probformer export" in capsys.readouterr().err
    assert {p: p.read_bytes() for folder in (step, run / "model", plain) for p in folder.iterdir()} == before


@settings(max_examples=30, deadline=None)
@given(
    extras=st.sets(
        st.sampled_from(["training.json", "training.safetensors", "tags.json", "notes.txt", "loader.py", ".hidden"])
    ),
    header=st.booleans(),
)
def test_only_a_folder_holding_what_export_wrote_is_replaced(tmp_path_factory, extras, header):
    """Oracle: replaceable exactly when the folder holds an export's files and nothing else,
    its weights' header naming the format as export writes it."""
    from safetensors.torch import load_file

    from probformer.deploy import exporter

    folder = probformer.export(transformer(), tmp_path_factory.mktemp("e") / "model", vocabulary=None)
    if not header:  # rewritten as a training run writes its weights
        save_file(load_file(str(folder / "model.safetensors")), str(folder / "model.safetensors"))
    for name in extras:
        (folder / name).write_text("{}")
    if extras <= {"tags.json"} and header:  # a tagger's export holds its tags.json
        exporter._check_replaceable(folder)
    else:
        with pytest.raises(FileExistsError, match="is not a probformer export"):
            exporter._check_replaceable(folder)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """A run's model/, a training checkpoint and a torch export of one model."""
    from probformer.training import run_checkpoints

    root, model = tmp_path_factory.mktemp("folders"), transformer()
    optimizer = torch.optim.AdamW(model.parameters())
    step = run_checkpoints.save_training_checkpoint(root / "run", 2, model, optimizer, None, {"step": 2})
    run_checkpoints.save_final_model(root / "run", model, None, None)
    return model, [root / "run" / "model", step, probformer.export(model, root / "export")]


@settings(max_examples=40, deadline=None)
@given(
    which=st.integers(0, 2),
    below=st.lists(st.sampled_from(["sub", "deeper", "model"]), max_size=2),
    name=st.sampled_from(["model.onnx", "model.pt2", "model", "config.json"]),
)
def test_export_refuses_a_path_inside_a_model_folder(model_folders, which, below, name):
    """Oracle: the folder's bytes are unchanged and it still loads as the same model."""
    model, folders = model_folders
    folder = folders[which]
    before = {p: p.read_bytes() for p in folder.iterdir()}
    format = {".onnx": "onnx", ".pt2": "exported"}.get(Path(name).suffix, "torch")
    with pytest.raises(ValueError, match=f"lies inside the model folder {folder}"):
        probformer.export(model, folder.joinpath(*below, name), format)
    assert {p: p.read_bytes() for p in folder.iterdir()} == before
    assert_reproduces(model, probformer.load(folder))


def test_export_beside_a_model_folder_is_written(model_folders):
    model, folders = model_folders
    assert_reproduces(model, probformer.load(probformer.export(model, folders[0].parent / "beside.pt2", "exported")))


def test_loaded_models_check_their_inputs(exported):
    for path in exported.values():
        model = probformer.load(path)
        with pytest.raises(ValueError, match="token ids must lie in"):
            model(torch.tensor([[VOCAB]]))
        with pytest.raises(ValueError, match="at least one real token"):
            model(torch.tensor([[1, 2]]), torch.tensor([[False, False]]))
        with pytest.raises(ValueError, match="exceeds max_length"):
            model(torch.zeros(1, 21, dtype=torch.long))
