"""The projections (inference.mean_field.projections): shared projections equal the per-group
form, and projecting only the used groups equals the naive kernel."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field import projections
from tests.builders import padded_token_batch as batch
from tests.builders import shared_crf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "topology, schedule",
    [("causal", "async"), ("window(2)", "async"), ("chain()", "parallel"), ("causal | root()", "macaron")],
)
def test_mean_field_projecting_only_the_used_groups_equals_naive(topology, schedule):
    """MeanField with the fused kernel projects onto the groups with arcs alone, each group
    its own GEMM output (``GemmTables.as_groups``), and back-projects its messages itself: its label
    marginals, head marginals and parameter gradients equal the naive kernel's (all groups,
    one tensor, ``back_project``), on every unrolled schedule."""
    torch.manual_seed(0)
    globals_ = 2 if schedule == "macaron" else 0  # macaron alternates global and head updates
    crf = graphs.CRF(vocab_size=11, labels=4, channels=2, rank=3, topology=topology, gamma=3, global_labels=globals_)
    crf = crf.double()
    tokens = torch.randint(0, 11, (2, 140))
    mask = torch.ones(2, 140, dtype=torch.bool)
    mask[1, 90:] = False
    results = []
    for kernel in ("fused", "naive"):
        crf.zero_grad()
        engine = inference.MeanField(crf, iterations=2, kernel=kernel, schedule=schedule)
        posterior = engine(tokens, mask)
        posterior.logits.square().sum().backward()
        results.append([posterior.z, posterior.h, *(p.grad.clone() for p in crf.parameters() if p.grad is not None)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def per_group_copy(crf, rank_extra: bool):
    """A low-rank CRF holding the shared form per group: with ``rank_extra`` the exact
    rank r + 1 equivalent (the bias in a last column), else the plain U, V copies."""
    folded_u, folded_v = crf.ternary_factors()
    rank = folded_u.shape[-1] if rank_extra else crf.rank
    low_rank = graphs.CRF(
        vocab_size=7,
        labels=crf.labels,
        channels=crf.channels,
        rank=rank,
        gamma=crf.gamma,
        topology=crf.topology,
        global_labels=crf.global_labels,
    ).double()
    K = crf.num_groups
    with torch.no_grad():
        low_rank.unary.copy_(crf.unary)
        if crf.global_labels:
            low_rank.binary.copy_(crf.binary)
        if rank_extra:
            low_rank.ternary_u.copy_(folded_u)
            low_rank.ternary_v.copy_(folded_v)
        else:
            low_rank.ternary_u.copy_(crf.shared_u.expand(K, -1, -1, -1))
            low_rank.ternary_v.copy_(crf.shared_v.expand(K, -1, -1, -1))
    return low_rank


@pytest.mark.parametrize("schedule", ["async", "parallel", "macaron", "sequential"])
@pytest.mark.parametrize("topology", ["full", "star()"])
def test_shared_projections_equal_the_per_group_form(schedule, topology):
    """bias 0: exactly the low-rank form with U, V copied into every group (same logits);
    any bias, CRF weights: the rank r + 1 form (same marginals and ELBO; label logits may
    differ by a constant per node, the bias's message, which no softmax sees)."""
    crf = shared_crf(labels=3, rank=2, gamma=1, topology=topology, global_labels=2, bias_std=0.0)
    tokens, mask = batch(length=6)
    options = dict(iterations=2, schedule=schedule, kernel="naive", weights="reference")
    shared, copied = (inference.MeanField(c, **options)(tokens, mask) for c in (crf, per_group_copy(crf, False)))
    torch.testing.assert_close(shared.logits, copied.logits, atol=1e-12, rtol=0)
    if schedule == "parallel":
        # the Jacobi start (zero projections: no label information) keeps the bias, a potential
        # on the heads alone, where the rank r + 1 form's last column is zeroed with the rest
        return
    with torch.no_grad():
        crf.shared_bias.normal_()
    options["weights"] = "crf"
    shared, folded = (inference.MeanField(c, **options)(tokens, mask) for c in (crf, per_group_copy(crf, True)))
    torch.testing.assert_close(shared.z, folded.z, atol=1e-12, rtol=0)
    torch.testing.assert_close(shared.elbo, folded.elbo, atol=1e-12, rtol=0)


@settings(max_examples=25, deadline=None)
@given(K=st.integers(1, 3), C=st.integers(1, 3), d=st.integers(1, 4), extra=st.integers(1, 4))
def test_tables_at_label_rank_keep_their_product(K, C, d, extra):
    """``at_label_rank``: tables of rank r = d + extra -> ``(T, I)`` of rank d with the same
    ``T = u v^T`` (sums written here), differentiable into u and v."""
    generator = torch.Generator().manual_seed(K * 100 + C * 10 + d + extra)
    u, v = (torch.randn(K, C, d, d + extra, generator=generator, dtype=torch.float64) for _ in range(2))
    table, identity = projections.at_label_rank(u, v)
    assert table.shape == identity.shape == (K, C, d, d)
    product = torch.zeros(K, C, d, d, dtype=torch.float64)
    for rank in range(d + extra):
        product += u[..., :, rank, None] * v[..., None, :, rank]
    torch.testing.assert_close(table, product)
    torch.testing.assert_close(identity, torch.eye(d, dtype=torch.float64).expand(K, C, d, d))
    torch.testing.assert_close(table @ identity.transpose(-1, -2), product)


def test_tables_at_label_rank_stay_float32_under_autocast():
    """Under bfloat16 autocast the table is the float32 product (rounded once, later, where a
    GEMM reads it), not a product of rounded factors."""
    generator = torch.Generator().manual_seed(0)
    u, v = (torch.randn(2, 3, 4, 9, generator=generator) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table, _ = projections.at_label_rank(u, v)
    assert table.dtype == torch.float32
    torch.testing.assert_close(table, torch.einsum("kcar,kcbr->kcab", u.double(), v.double()).float())


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    N=st.integers(1, 9),
    K=st.integers(1, 4),
    C=st.integers(1, 3),
    r=st.integers(1, 4),
    d=st.integers(1, 5),
    groups=st.booleans(),
    slot_major=st.booleans(),
    grouped=st.booleans(),
)
def test_project_and_back_project_equal_their_sums(B, N, K, C, r, d, groups, slot_major, grouped):
    """project: query[b, i, k, c] = sum_a q[b, i, a] U[k, c, a] (as one tensor, or as the
    tuple of its groups); back_project: sum over the groups, channels and ranks of head *
    forward U + dependents * reverse V, whichever layout the messages are stored in;
    gradients included (float64 sums written here)."""
    generator = torch.Generator().manual_seed(B * 1000 + N * 100 + K * 10 + C + r + d)
    u, v = (torch.randn(K, C, d, r, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    q_z = torch.randn(B, N, d, generator=generator, dtype=torch.float64, requires_grad=True)
    kept = tuple(range(K))[::2] if groups else None
    scales = {"head": 0.7, "dependents": -1.3}
    tables = projections.GemmTables.of(u, v, scales, kept, as_groups=grouped)
    u_kept, v_kept = (t if kept is None else t[list(kept)] for t in (u, v))
    query, key = projections.project(q_z, tables)
    read = torch.arange(u_kept.shape[0]) % 2 == 0  # the loss reads only these groups of query
    if grouped:  # each group its own tensor, its own gradient edge (unread ones: None)
        assert isinstance(query, tuple) and len(query) == len(key) == u_kept.shape[0]
        query_read = sum(g.square().sum() for g, used in zip(query, read, strict=True) if used)
        query, key = torch.stack(query, 2), torch.stack(key, 2)
    else:
        query_read = query[:, :, read].square().sum()
    torch.testing.assert_close(query, torch.einsum("bia,kcar->bikcr", q_z, u_kept))
    torch.testing.assert_close(key, torch.einsum("bia,kcar->bikcr", q_z, v_kept))
    k_kept = u_kept.shape[0]
    messages = torch.randn(2, k_kept, B, N, C, r, generator=generator, dtype=torch.float64, requires_grad=True)
    stacked = messages.permute(2, 3, 0, 1, 4, 5)  # slot-major storage, as the fused kernel writes
    if not slot_major:
        stacked = stacked.contiguous()
    assert projections._slot_major(stacked) == (slot_major or B * N == 1)  # the branch under test
    logits = projections.back_project(stacked, tables)
    expected = 0.7 * torch.einsum("bikcr,kcar->bia", stacked[:, :, 0], u_kept)
    expected = expected - 1.3 * torch.einsum("bikcr,kcar->bia", stacked[:, :, 1], v_kept)
    torch.testing.assert_close(logits, expected)
    weights = torch.randn(B, N, d, generator=generator, dtype=torch.float64)
    loss = (weights * logits).sum() + (query_read - key.sum())
    oracle = (weights * expected).sum()
    oracle = oracle + torch.einsum("bia,kcar->bikcr", q_z, u_kept)[:, :, read].square().sum()
    oracle = oracle - torch.einsum("bia,kcar->bikcr", q_z, v_kept).sum()
    inputs = (u, v, q_z, messages)
    for got, want in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(oracle, inputs), strict=True):
        torch.testing.assert_close(got, want)


def test_label_logits_use_the_kernels_back_projection_only_through_its_own_tables():
    """The fused kernel's ``label_message`` went through the tables it was given: label
    logits with those tables use it; with other tables (here after a parameter update)
    they back-project the messages through the tables given, never the stale message."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=11, labels=4, channels=2, rank=3, topology="window(3)", gamma=2).double()
    engine = inference.MeanField(crf, iterations=1, kernel="fused")
    tokens = torch.randint(0, 11, (2, 30))
    _, _, structure = engine.structure(tokens, None)
    N = structure.nodes.shape[1]
    q_z = torch.rand(2, N, 4, dtype=torch.float64).softmax(-1)
    unary = torch.zeros(2, N, 4, dtype=torch.float64)
    tables = engine.gemm_tables(structure, "fused")
    query, key = engine.project(q_z, tables)
    assert isinstance(query, tuple)  # the fused kernel's tables hand out the groups
    heads = engine.heads(query, key, key, query, structure, "fused", tables=tables)
    assert heads.label_back is tables.back
    scale = engine.scales()["unary"]
    torch.testing.assert_close(engine.label_logits(unary, heads, None, tables), scale * unary + heads.label_message)
    with torch.no_grad():
        crf.ternary_u.add_(1.0)
    other = engine.gemm_tables(structure, "fused")
    expected = scale * unary + projections.back_project(heads.stacked, other)
    torch.testing.assert_close(engine.label_logits(unary, heads, None, other), expected)
    assert not torch.allclose(expected, scale * unary + heads.label_message)
