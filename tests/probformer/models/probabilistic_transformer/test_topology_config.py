"""A PT on a topology given as data: a networkx graph, a bool mask or a
graphs.Topology in PTConfig(topology=...) is stored as its arc list, so the config is JSON,
a save / load round trip restores the same arcs and logits, and a topology with no stored
form (a callable) is refused when the config is built, before anything is written."""

from __future__ import annotations

import json

import networkx as nx
import pytest
import torch

import graphs
import probformer
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig

N_MAX = 10


def alternating_graph() -> nx.DiGraph:
    """Even positions may choose the next position, odd ones the previous two: not a built-in."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(N_MAX))
    for i in range(N_MAX):
        for j in [i + 1] if i % 2 == 0 else [i - 1, i - 2]:
            if 0 <= j < N_MAX:
                graph.add_edge(i, j)
    return graph


def expected_arcs(n: int) -> torch.Tensor:
    arcs = torch.zeros(n, n, dtype=torch.bool)
    for i, j in alternating_graph().edges:
        if i < n and j < n:
            arcs[i, j] = True
    return arcs


@pytest.mark.parametrize("given", ["graph", "mask", "topology"])
def test_a_graph_topology_is_stored_as_arcs_and_round_trips(given, tmp_path):
    graph = alternating_graph()
    value = {
        "graph": graph,
        "mask": torch.tensor(nx.to_numpy_array(graph, nodelist=range(N_MAX)) > 0),
        "topology": graphs.topology.parse(graph),
    }[given]
    config = PTConfig(vocab_size=12, labels=6, channels=2, rank=3, iterations=2, dropout=0.0, topology=value)
    assert set(config.topology) == {"arcs", "n_max"} and config.topology["n_max"] == N_MAX
    assert json.loads(json.dumps(config.to_dict()))["topology"] == config.topology  # plain JSON
    torch.manual_seed(0)
    model = ProbabilisticTransformer(config).eval()
    for n in (1, 4, 7):  # the model's arcs are the graph's subgraph on 0..n-1
        got = model.crf.topology.mask(n)[:n, :n]
        assert torch.equal(got, expected_arcs(n))
    tokens = torch.randint(0, 12, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    model.save_pretrained(tmp_path / "saved")
    loaded = ProbabilisticTransformer.from_pretrained(tmp_path / "saved")
    assert loaded.config.topology == config.topology
    with torch.no_grad():
        assert torch.equal(loaded(tokens, mask)[0], model(tokens, mask)[0])
    exported = probformer.export(model, tmp_path / "export", format="torch")
    with torch.no_grad():
        assert torch.equal(probformer.load(exported).model(tokens, mask)[0], model(tokens, mask)[0])


@pytest.mark.slow
def test_traced_formats_of_a_graph_topology(tmp_path):
    """ONNX holds the arcs (lengths 1..n_max); .pt2 refuses them by name."""
    torch.manual_seed(0)
    config = PTConfig(
        vocab_size=12, labels=6, channels=2, rank=3, iterations=2, dropout=0.0, topology=alternating_graph()
    )
    model = ProbabilisticTransformer(config).eval()
    tokens = torch.randint(0, 12, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    onnx = probformer.load(probformer.export(model, tmp_path / "model.onnx", format="onnx"))
    with torch.no_grad():
        torch.testing.assert_close(onnx(tokens, mask), model(tokens, mask)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="topology given as arcs"):
        probformer.export(model, tmp_path / "model.pt2", format="exported")


def test_a_builtin_topology_object_is_stored_as_its_text():
    config = PTConfig(vocab_size=12, labels=6, channels=2, rank=3, topology=graphs.topology.parse("window(2) | star()"))
    assert config.topology == graphs.topology.parse("window(2) | star()").to_data()["text"]


def test_a_topology_with_no_stored_form_is_refused_when_the_config_is_built():
    made = graphs.topology.from_callable(lambda n: torch.ones(n, n, dtype=torch.bool).triu(1))
    with pytest.raises(ValueError, match="config key 'topology'.*cannot be stored"):
        PTConfig(vocab_size=12, labels=6, channels=2, rank=3, topology=made)
    with pytest.raises(ValueError, match="config key 'topology'"):
        PTConfig(vocab_size=12, labels=6, channels=2, rank=3, topology={"arcs": [[0, 5]], "n_max": 2})


def test_a_pt_with_distance_buckets_round_trips(tmp_path):
    """PTConfig(gamma=[2, 4]): the reference's dists = "2, 4" in a trainable model,
    stored as JSON and restored with the same logits; bad cut points named by the config key."""
    torch.manual_seed(0)
    config = PTConfig(vocab_size=12, labels=6, channels=2, rank=3, iterations=2, dropout=0.0, gamma=[2, 4])
    model = ProbabilisticTransformer(config).eval()
    assert model.crf.distance_cuts == (2, 4) and model.crf.ternary_u.shape[0] == 2 * 3
    tokens = torch.randint(0, 12, (2, 9))
    model.save_pretrained(tmp_path / "saved")
    loaded = ProbabilisticTransformer.from_pretrained(tmp_path / "saved")
    assert loaded.config.gamma == [2, 4]
    with torch.no_grad():
        assert torch.equal(loaded(tokens)[0], model(tokens)[0])
    with pytest.raises(ValueError, match="config key 'gamma'"):
        PTConfig(vocab_size=12, labels=6, channels=2, rank=3, gamma=[4, 2])


@pytest.mark.parametrize("kernel", ["naive", "fused"])
def test_a_pt_on_star_wrap_compiles_in_one_graph_and_equals_eager(kernel):
    """star(wrap=True) builds each row's arcs from its mask; it did so inside a torch.device
    context, which Dynamo cannot trace: fullgraph=True failed on any such model."""
    torch.manual_seed(0)
    config = PTConfig(vocab_size=20, labels=16, channels=2, rank=32, iterations=2, dropout=0.0, kernel=kernel,
                      topology="star(wrap=True)")  # fmt: skip
    model = ProbabilisticTransformer(config).eval()
    tokens, mask = torch.randint(0, 20, (2, 12)), torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break raises
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens, mask)[0], model(tokens, mask)[0], rtol=0, atol=0)
