"""A PT with a declared Pairwise factor (PTConfig(pairwise="chain()"): a linear-chain CRF
over its labels) exports to every format with a dynamic batch and length; a user factor
is refused by the torch folder (it is code) and traced by ONNX."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
from graphs.factors import Pairwise
from probformer.deploy import exporter, load
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig

torch.set_num_threads(1)


def chain_tagger(**overrides) -> ProbabilisticTransformer:
    torch.manual_seed(0)
    config = dict(vocab_size=30, labels=6, channels=2, rank=3, iterations=2, task="tagging", num_classes=5)
    model = ProbabilisticTransformer(PTConfig(**{**config, "pairwise": "chain()", **overrides})).eval()
    with torch.no_grad():  # a transition table large enough to change the tags
        model.crf.factors[0].table.mul_(4)
    return model


def batches():
    """Two shapes other than the traced one (batch 2, length 5), one with padding."""
    generator = torch.Generator().manual_seed(1)
    short = torch.randint(0, 30, (1, 3), generator=generator), torch.ones(1, 3, dtype=torch.bool)
    tokens = torch.randint(0, 30, (4, 8), generator=generator)
    return [short, (tokens, torch.arange(8)[None] < torch.tensor([8, 6, 2, 1])[:, None])]


@pytest.mark.parametrize(
    "format",
    ["torch", "exported", pytest.param("onnx", marks=pytest.mark.slow)],  # ONNX: ~25 s to trace
)
def test_chain_crf_pt_exports_and_loads_with_the_source_logits(tmp_path, format):
    model = chain_tagger()
    path = exporter.export(model, tmp_path / f"tagger.{format}", format=format)
    loaded = load(path)
    without_pairwise = chain_tagger()
    with torch.no_grad():
        without_pairwise.crf.factors[0].table.zero_()
    for tokens, mask in batches():
        with torch.no_grad():
            expected = model(tokens, mask)[0]
            found = loaded(tokens, mask)
            baseline = without_pairwise(tokens, mask)[0]
        assert found.shape == expected.shape
        torch.testing.assert_close(found.float(), expected.float(), atol=1e-5, rtol=0)
        assert (baseline - expected).abs().max() > 1e-3  # the exported graph holds the pairwise factor


def messages_written_here(factor: Pairwise, q, mask):
    """The mean-field message and E_q[log phi] of a Pairwise, one arc at a time."""
    B, n = mask.shape
    arcs, groups = factor.arcs(mask), graphs.topology.distance_groups(n, factor.gamma)
    message, expected = torch.zeros(B, n, factor.labels, dtype=q.dtype), torch.zeros(B, dtype=q.dtype)
    for b in range(B):
        for i in range(n):
            for j in range(n):
                if arcs[b, i, j]:
                    table = factor.table[groups[i, j]]
                    message[b, i] += table @ q[b, j]
                    message[b, j] += table.T @ q[b, i]
                    expected[b] += q[b, i] @ table @ q[b, j]
    return message, expected


@settings(max_examples=25, deadline=None)
@given(
    topology=st.sampled_from(["chain()", "causal()", "window(2)", "full()"]),
    gamma=st.integers(0, 2),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_pairwise_messages_equal_the_arc_by_arc_sums(topology, gamma, lengths, seed):
    torch.manual_seed(seed)
    factor = Pairwise(3, topology, gamma).double()
    n = max(lengths)
    mask = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    q = torch.rand(len(lengths), n, 3, dtype=torch.float64).softmax(-1) * mask[..., None]
    tokens = torch.zeros(len(lengths), n, dtype=torch.long)
    message, expected = messages_written_here(factor, q, mask)
    torch.testing.assert_close(factor.message(q, tokens, mask), message)
    torch.testing.assert_close(factor.expected_log_potential(q, tokens, mask), expected)


class NoRepeat(graphs.Factor):
    """Penalise two neighbouring tokens with the same label (docs/factors.md's user factor)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(-2.0))

    def log_potential(self, z, tokens, mask):
        n = tokens.shape[1]
        return self.weight * ((z[:, 1:n] == z[:, : n - 1]) & mask[:, 1:]).to(self.weight.dtype).sum(-1)

    def expected_log_potential(self, q, tokens, mask):
        n = tokens.shape[1]
        return self.weight * ((q[:, 1:n] * q[:, : n - 1]).sum(-1) * mask[:, 1:]).sum(-1)


def with_user_factor() -> ProbabilisticTransformer:
    model = chain_tagger()
    factor = NoRepeat()
    factor.name = "norepeat"
    model.crf.factors.append(factor)
    return model


def test_the_torch_folder_refuses_a_user_factor_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"format 'torch' cannot hold a PT with the user factor\(s\) 'norepeat' \("):
        exporter.export(with_user_factor(), tmp_path / "tagger", format="torch")
    assert not (tmp_path / "tagger").exists()


def test_save_pretrained_refuses_a_factor_the_config_does_not_declare(tmp_path):
    refused = r"cannot save the factor\(s\) 'norepeat' \(NoRepeat\): they are not the config's"
    with pytest.raises(ValueError, match=refused):
        with_user_factor().save_pretrained(tmp_path / "tagger")
    assert not (tmp_path / "tagger").exists()
    chain_tagger().save_pretrained(tmp_path / "declared")  # the declared Pairwise is data: saved


@pytest.mark.slow  # one ONNX trace (~25 s)
def test_onnx_traces_a_user_factor_and_its_autograd_messages(tmp_path):
    model = with_user_factor()
    loaded = load(exporter.export(model, tmp_path / "tagger.onnx", format="onnx"))
    for tokens, mask in batches():
        with torch.no_grad():
            torch.testing.assert_close(loaded(tokens, mask), model(tokens, mask)[0], atol=1e-5, rtol=0)
