"""Factor templates (graphs.factors) under Exact, against oracles written here: brute-force
sums over every labelling, a linear-chain forward algorithm, and pgmpy's variable
elimination. The oracles read the raw parameters and recompute every potential."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pyro import poutine

import graphs
import inference
from graphs.factors import Pairwise
from tests.builders import FirstLastAgree


def group(i, j, gamma):
    delta = j - i
    a = min(abs(delta), gamma + 1)
    return a - 1 if delta > 0 else gamma + a


def legal_heads(topology, length):
    mask = topology.mask(length)
    return [[j for j in range(length) if mask[i, j]] for i in range(length)]


def brute_force_log_z(crf, tokens_row, length):
    """log Z of one sentence of ``length`` real tokens (no virtual nodes): every labelling,
    each head and global variable summed in closed form given the labels."""
    S = crf.unary.detach().double()
    T = torch.einsum("kcar,kcbr->kcab", crf.ternary_u.detach().double(), crf.ternary_v.detach().double())
    heads = legal_heads(crf.topology, length)
    terms = []
    for z in itertools.product(range(crf.labels), repeat=length):
        s = sum(S[tokens_row[i], z[i]].item() for i in range(length))
        for c in range(crf.channels):
            for i in range(length):
                if heads[i]:
                    s += torch.tensor([T[group(i, j, crf.gamma), c, z[i], z[j]] for j in heads[i]]).logsumexp(0).item()
        if crf.global_labels:
            Bm = crf.binary.detach().double()
            s += sum(Bm[:, z[i]].logsumexp(0).item() for i in range(length))
        for factor in crf.factors:
            if isinstance(factor, Pairwise):
                P = factor.table.detach().double()
                pair_heads = legal_heads(factor.topology, length)
                s += sum(P[group(i, j, factor.gamma), z[i], z[j]].item() for i in range(length) for j in pair_heads[i])
            else:  # FirstLastAgree
                s += factor.weight.item() * (z[0] == z[length - 1])
        terms.append(float(s))
    return torch.tensor(terms, dtype=torch.float64).logsumexp(0).item()


@st.composite
def declared_crfs(draw):
    labels = draw(st.integers(1, 3))
    n = draw(st.integers(1, 4 if labels < 3 else 3))
    extra = []
    if draw(st.booleans()):
        topology = draw(st.sampled_from(["chain()", "window(1)", "full", "causal"]))
        extra.append(Pairwise(labels, topology, gamma=draw(st.integers(0, 2))))
    if draw(st.booleans()):
        extra.append(FirstLastAgree())
    crf = graphs.CRF(
        vocab_size=5,
        labels=labels,
        channels=draw(st.integers(1, 2)),
        rank=2,
        global_labels=draw(st.sampled_from([0, 2])),
        topology=draw(st.sampled_from(["full", "window(1)", "causal", "chain()"])),
        factors=extra,
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    B = draw(st.integers(1, 2))
    tokens = torch.randint(0, 5, (B, n), generator=gen)
    lengths = [draw(st.integers(1, n)) for _ in range(B)]
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return crf, tokens, mask


@settings(max_examples=25)
@given(data=declared_crfs())
def test_exact_log_partition_of_declared_templates_equals_brute_force(data):
    crf, tokens, mask = data
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
    assert log_z.dtype == torch.float64
    for b in range(tokens.shape[0]):
        length = int(mask[b].sum())
        assert log_z[b].item() == pytest.approx(brute_force_log_z(crf, tokens[b].tolist(), length), abs=1e-8)


def test_log_potential_includes_every_template():
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, topology="chain()", factors=[Pairwise(2), FirstLastAgree(0.5)])
    tokens, z = torch.tensor([[1, 3, 4]]), torch.tensor([[0, 1, 0]])
    h = torch.tensor([[[0, 0, 1]]])  # node 0 has no head (ignored); 1 -> 0, 2 -> 1
    S, P = crf.unary.detach(), crf.factors[0].table.detach()
    T = torch.einsum("kcar,kcbr->kcab", crf.ternary_u, crf.ternary_v).detach()
    expected = S[1, 0] + S[3, 1] + S[4, 0]
    expected += T[group(1, 0, crf.gamma), 0, 1, 0] + T[group(2, 1, crf.gamma), 0, 0, 1]
    expected += P[1, 1, 0] + P[1, 0, 1] + 0.5  # chain arcs i -> i - 1 (group 1); z_0 == z_2
    assert crf.log_potential(tokens, z, h).item() == pytest.approx(expected.item(), abs=1e-5)


def test_unary_and_chain_pairwise_is_the_linear_chain_crf_forward_algorithm():
    """On a chain topology with a zero ternary table every head has one choice and adds
    nothing, so the CRF is unary + transitions: the forward algorithm's log Z and its
    forward-backward marginals."""
    torch.manual_seed(4)
    d, n = 3, 5
    pairwise = Pairwise(d, "chain()")
    crf = graphs.CRF(vocab_size=7, labels=d, channels=1, rank=1, topology="chain()", factors=[pairwise]).double()
    with torch.no_grad():
        crf.ternary_u.zero_()
    tokens = torch.tensor([[3, 0, 6, 2, 5]])
    emissions = crf.unary.detach()[tokens[0]]  # [n, d]
    transition = pairwise.table.detach()[1].T  # trans[a, b] = table[k(i, i-1)][z_i = b, z_{i-1} = a]
    alpha = [emissions[0]]
    for t in range(1, n):
        alpha.append((alpha[-1][:, None] + transition).logsumexp(0) + emissions[t])
    beta = [torch.zeros(d, dtype=torch.float64)]
    for t in range(n - 1, 0, -1):
        beta.insert(0, (transition + emissions[t] + beta[0]).logsumexp(1))
    log_z = alpha[-1].logsumexp(0)
    marginals = torch.stack([(a + b - log_z).exp() for a, b in zip(alpha, beta)])
    with torch.no_grad():
        post = inference.Exact(crf)(tokens)
    assert post.log_partition.item() == pytest.approx(log_z.item(), abs=1e-10)
    torch.testing.assert_close(post.z[0], marginals, atol=1e-10, rtol=0)


def test_exact_marginals_equal_pgmpy_variable_elimination():
    """pgmpy's VariableElimination on the same factor graph written as pgmpy factors:
    unary phi(Z_i), pairwise phi(Z_i, Z_j), head phi(H_i, Z_i, Z_j) = exp(T) if H_i = j."""
    from pgmpy.factors.discrete import DiscreteFactor
    from pgmpy.inference import VariableElimination
    from pgmpy.models import DiscreteMarkovNetwork

    torch.manual_seed(5)
    d, n = 2, 3
    crf = graphs.CRF(vocab_size=4, labels=d, channels=1, rank=2, topology="window(1)", factors=[Pairwise(d, "chain()")])
    tokens = torch.tensor([[1, 3, 0]])
    S = crf.unary.detach().double()
    T = torch.einsum("kar,kbr->kab", crf.ternary_u.detach().double()[:, 0], crf.ternary_v.detach().double()[:, 0])
    P = crf.factors[0].table.detach().double()
    heads = legal_heads(crf.topology, n)
    net = DiscreteMarkovNetwork()
    net.add_nodes_from([f"z{i}" for i in range(n)] + [f"h{i}" for i in range(n)])
    factors = [DiscreteFactor([f"z{i}"], [d], S[tokens[0, i]].exp().numpy()) for i in range(n)]
    for i in range(1, n):  # chain arc i -> i - 1
        factors.append(DiscreteFactor([f"z{i}", f"z{i - 1}"], [d, d], P[group(i, i - 1, 0)].exp().numpy()))
    for i in range(n):
        for slot, j in enumerate(heads[i]):
            values = torch.ones(len(heads[i]), d, d, dtype=torch.float64)
            values[slot] = T[group(i, j, crf.gamma)].exp()
            factors.append(DiscreteFactor([f"h{i}", f"z{i}", f"z{j}"], list(values.shape), values.numpy()))
    for f in factors:
        net.add_edges_from(itertools.combinations(f.scope(), 2))
    net.add_factors(*factors)
    with torch.no_grad():
        post = inference.Exact(crf).marginals(tokens)
    log_z = inference.Exact(crf).log_partition(tokens)  # float64 (the Posterior's is in the CRF's float32)
    assert log_z.item() == pytest.approx(math.log(net.get_partition_function()), abs=1e-9)
    elimination = VariableElimination(net)

    def query(name):  # a Markov network's query is unnormalised
        values = torch.tensor(elimination.query([name], show_progress=False).values)
        return values / values.sum()

    for i in range(n):
        torch.testing.assert_close(post.z[0, i].double(), query(f"z{i}"), atol=1e-6, rtol=0)
        torch.testing.assert_close(post.h[0, 0, i, heads[i]].double(), query(f"h{i}"), atol=1e-6, rtol=0)


def test_a_factor_without_log_potential_says_what_to_implement():
    class Empty(graphs.Factor):
        pass

    crf = graphs.CRF(vocab_size=4, labels=2, factors=[Empty()])
    with pytest.raises(ValueError, match=r"Exact cannot compile factor 'empty0' \(Empty\) \(implement log_potential"):
        inference.Exact(crf)
    z, h = torch.zeros(1, 2, dtype=torch.long), torch.tensor([[[1, 0]]])
    with pytest.raises(NotImplementedError, match=r"Empty must implement log_potential\(z, tokens, mask\)"):
        crf.log_potential(torch.tensor([[1, 2]]), z, h)


@pytest.mark.parametrize(
    "method", ["log_potential", "expected_log_potential", "message", "tables", "arcs", "add_to_model"]
)
def test_a_pairwise_subclass_that_scores_otherwise_is_refused_by_name(method):
    """The engines compile a Pairwise from its table: an override of how it scores would be
    one factor to crf.log_potential and another to Exact, MeanField and Gibbs."""

    def override(self, *args, **kwargs):
        return getattr(Pairwise, method)(self, *args, **kwargs)

    Changed = type("Changed", (Pairwise,), {method: override})
    with pytest.raises(TypeError, match=rf"Changed overrides Pairwise.{method}: .*from graphs.Factor"):
        graphs.CRF(vocab_size=4, labels=2, factors=[Changed(2)])

    class Renamed(Pairwise):  # a new constructor only: still the table's factor
        def __init__(self, labels):
            super().__init__(labels, "window(2)")

    graphs.CRF(vocab_size=4, labels=2, factors=[Renamed(2)])


class Zero(graphs.Factor):
    def log_potential(self, z, tokens, mask):
        return torch.zeros(z.shape[0])


# stems of generated site names with their number of indices, and names no site has
STEMS = {"z": 1, "g": 1, "unary": 1, "binary": 1, "h": 2, "head_count": 2, "ternary": 3, "batch": 0, "a": 2}
STEMS |= {"_INPUT": 0, "_RETURN": 0, "zz": 1}


@st.composite
def site_names(draw):
    """A stem and its number of indices (a user factor's whole name), two fewer (a Pairwise
    adds two), or any number; indices as written (0 to 2) or not (01)."""
    stem = draw(st.sampled_from(sorted(STEMS)))
    count = draw(st.sampled_from([STEMS[stem], max(STEMS[stem] - 2, 0), draw(st.integers(0, 3))]))
    return "_".join([stem, *draw(st.lists(st.sampled_from(["0", "1", "2", "01"]), min_size=count, max_size=count))])


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(site_names(), min_size=1, max_size=2, unique=True),
    kinds=st.lists(st.sampled_from(["user", "pairwise"]), min_size=2, max_size=2),
    channels=st.integers(1, 2),
    global_labels=st.sampled_from([0, 2]),
)
def test_a_factor_name_is_refused_exactly_when_pyro_would_meet_two_sites_of_that_name(
    names, kinds, channels, global_labels
):
    """The oracle is Pyro itself: the CRF built without the check, its model traced on a
    sentence where every index a name can hold (0 to 2) is some site's (full topologies)."""

    def factors():
        made = [Zero() if kind == "user" else Pairwise(2, "full()") for kind, _ in zip(kinds, names)]
        for factor, name in zip(made, names):
            factor.name = name
        return made

    options = dict(vocab_size=5, labels=2, channels=channels, rank=1, topology="full()", global_labels=global_labels)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphs.factors, "_refuse_clashing_sites", lambda crf, extra: None, raising=False)
        unchecked = graphs.CRF(**options, factors=factors())
    try:
        poutine.trace(unchecked.model).get_trace(torch.tensor([[1, 2, 3, 4]]))
        clashes = False
    except RuntimeError as error:
        assert "sites named" in str(error) or "already in the trace" in str(error), error
        clashes = True
    if clashes:
        with pytest.raises(ValueError, match=r"factors\[\d\] .*is named '.*': its site .*would share a name with"):
            graphs.CRF(**options, factors=factors())
    else:
        graphs.CRF(**options, factors=factors())


def test_a_factor_name_with_pattern_characters_is_read_as_text():
    """Names were put into a regular expression: 'p(x' raised a bare re.error and 'p.q' took
    'pxq_0_1' for one of its sites."""
    odd = Pairwise(2)
    odd.name = "p(x"
    graphs.CRF(vocab_size=4, labels=2, factors=[odd])
    dotted, user = Pairwise(2), FirstLastAgree()
    dotted.name, user.name = "p.q", "pxq_0_1"
    graphs.CRF(vocab_size=4, labels=2, factors=[dotted, user])
