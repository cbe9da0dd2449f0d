"""Export reproduces the source model (oracle: the trainable model itself, in eval mode) on
padded batches of several lengths: every kind in every format, the torch format as the
model's own config and weights, the PT on every topology and ternary form and with every
option, an example and a checkpoint with its vocabulary, a bf16 model in bf16."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probformer
from probformer.training import checkpoint, data
from tests.probformer.deploy.exporter.tiny_models import FILES, KINDS, TOLERANCE, VOCAB, assert_reproduces, folded, pt


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
