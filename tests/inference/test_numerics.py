"""No silent NaN or wrong number in the engines at extreme inputs.

The fused head kernel must be finite wherever the naive (materialised) kernel is, and
as close to the truth: potentials up to +-1e4, rows with no legal head, whole padded
sentences, float32 / float64 / bf16, every topology, with and without the CPU flash
kernel. ``Exact`` must give log Z to float64 rounding at any finite potential (checked
against an enumeration written here), so that the mean-field ELBO stays below it.
"""

import copy
import itertools
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field.engine import MeanField
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.head_kernels import HeadStructure
from tests import oracles

TOPOLOGIES = [
    "full",
    "causal",
    "window(1)",
    "window(4)",
    "star()",
    "star(wrap=True)",
    "root()",
    "clusters(2)",
    "clusters(2, dynamic=True)",
    "segments(3)",
    "segments(2, causal=True)",
    "window(1) | clusters(2)",
    "causal | star()",
]
SCALES = [0.1, 1.0, 10.0, 100.0, 1e3, 1e4]
# per dtype: the error allowed on top of "as close to float64 as the naive kernel", as a
# fraction of the output's largest entry ...
SLACK = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}
# ... plus the conditioning of exp(score - lse) at scores of size S: S times the relative
# accuracy of the fused kernel's arithmetic (bf16 is computed in float32; the CPU flash
# kernel's float32 exp and accumulation are good to ~2**-20, measured 10x the fallback's
# error). The naive kernel normalises each row with the lse of the very same rounded
# scores, so its errors cancel; the fused kernel's reverse messages divide by the lse of
# another row computed in another pass: at 1e4 in float32 it is ~1e-4 off where naive is ~1e-8.
ROUNDOFF = {torch.float64: 2**-52, torch.float32: 2**-20, torch.bfloat16: 2**-20}


def allowed_error(naive_error, dtype, potential):
    return 4 * naive_error + SLACK[dtype] + 4 * ROUNDOFF[dtype] * max(1.0, potential)


@pytest.fixture(autouse=True)
def keep_global_rng():
    """These tests seed torch's global RNG; give it back as it was, so that tests which
    run later and draw from it (tests/inference/test_smc.py) see what they saw without us."""
    with torch.random.fork_rng():
        yield


def structure_of(crf, mask):
    """The kernels' view of a batch, built from the CRF's own masks (no input checks, so
    whole padded sentences get through)."""
    n = mask.shape[1]
    return HeadStructure(
        n=n,
        gamma=crf.gamma,
        groups=crf.distance_groups(n),
        arcs=crf.arc_mask(mask),
        nodes=crf.node_mask(mask),
        token_arcs=crf.topology.mask(n)[:n, :n],
        band=crf.topology.band,
    )


@st.composite
def kernel_cases(draw):
    topology = draw(st.sampled_from(TOPOLOGIES))
    n = draw(st.integers(1, 9))
    batch = draw(st.integers(1, 3))
    rows = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(batch)]
    crf = graphs.CRF(vocab_size=3, labels=2, channels=2, rank=3, topology=topology, gamma=draw(st.integers(0, 3)))
    return dict(
        crf=crf,
        mask=torch.tensor(rows, dtype=torch.bool),
        potential=draw(st.sampled_from(SCALES)),
        dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
        attention_scale=draw(st.sampled_from([1.0, 0.3, 0.0, -1.0])),
        flash=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def kernel_inputs(crf, structure, potential, seed):
    """query, key, value, value_rev ``[B, N, K, C, r]`` (float64) whose largest legal head
    score is +-potential, and cotangents for every output."""
    B, N = structure.nodes.shape
    gen = torch.Generator().manual_seed(seed)
    shape = (B, N, crf.num_groups, crf.channels, crf.rank)
    query, key, value, value_rev = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    logits = head_kernels.naive_logits(query, key, 1.0, structure)
    largest = logits[structure.arcs[:, None].expand_as(logits)].abs().max() if structure.arcs.any() else 1.0
    factor = math.sqrt(potential / max(float(largest), 1e-3))
    query, key = query * factor, key * factor
    cotangents = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2)]
    cotangents.append(torch.randn(B, crf.channels, N, generator=gen, dtype=torch.float64))
    return [query, key, value, value_rev], cotangents


def run_kernel(kernel, inputs, cotangents, scale, structure, dtype):
    """Outputs (forward, reverse, lse) and the gradients of a random projection of them."""
    inputs = [t.to(dtype).requires_grad_() for t in inputs]
    out = kernel(*inputs, scale, structure)
    outputs = [out.forward, out.reverse, out.lse]
    loss = sum((o.double() * c).sum() for o, c in zip(outputs, cotangents))
    loss = loss + sum(t.sum() * 0 for t in inputs)  # a batch with no arc at all depends on nothing
    grads = torch.autograd.grad(loss, inputs)
    return [t.detach().double() for t in (*outputs, *grads)]


NAMES = ["forward", "reverse", "lse", "d query", "d key", "d value", "d value_rev"]


def relative_error(found, reference):
    return float((found - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


@settings(max_examples=300, deadline=None)
@given(case=kernel_cases())
def test_fused_is_finite_and_as_accurate_as_naive(case):
    crf, mask, dtype = case["crf"], case["mask"], case["dtype"]
    structure = structure_of(crf, mask)
    inputs, cotangents = kernel_inputs(crf, structure, case["potential"], case["seed"])
    rounded = [t.to(dtype).double() for t in inputs]  # the reference sees the very inputs the kernels see
    scale = case["attention_scale"]
    with mock.patch.object(head_kernels, "fused_available", lambda device: case["flash"]):
        fused = run_kernel(head_kernels.fused, inputs, cotangents, scale, structure, dtype)
    naive = run_kernel(head_kernels.naive, inputs, cotangents, scale, structure, dtype)
    truth = run_kernel(head_kernels.naive, rounded, cotangents, scale, structure, torch.float64)
    for name, f, a, t in zip(NAMES, fused, naive, truth):
        if not torch.isfinite(a).all():
            continue
        assert torch.isfinite(f).all(), f"fused {name} not finite where naive is"
        naive_error, fused_error = relative_error(a, t), relative_error(f, t)
        assert fused_error <= allowed_error(naive_error, dtype, case["potential"]), (name, fused_error, naive_error)


@pytest.mark.parametrize("messages", [True, False])
def test_log_normaliser_of_rows_without_heads_is_zero_with_zero_gradient(messages):
    """Whole padded sentences and causal row 0: lse = 0 exactly and no gradient, at +-1e4."""
    crf = graphs.CRF(vocab_size=3, labels=2, channels=2, rank=3, topology="causal | star()", gamma=1)
    mask = torch.tensor([[True, True, False, True, False], [False] * 5])
    structure = structure_of(crf, mask)
    (query, key, *_), _ = kernel_inputs(crf, structure, 1e4, 0)
    query, key = query.float().requires_grad_(), key.float().requires_grad_()
    lse = head_kernels.fused(query, key, key, query, 1.0, structure, messages=messages).lse
    lse.sum().backward()
    no_head = ~structure.has_head[:, None].expand_as(lse)
    assert (lse[no_head] == 0).all() and torch.isfinite(lse).all()
    assert (query.grad[1] == 0).all() and (key.grad[1] == 0).all()  # the padded sentence


@pytest.mark.parametrize("topology", ["full", "segments(3)", "clusters(2)", "causal | star()"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("potential", [10.0, 100.0, 1e4])
def test_mean_field_fused_is_finite_on_padded_rows_at_large_potentials(topology, dtype, potential):
    """The issue's reproduction: CRF parameters x10 and beyond, a short and a length-1
    sentence padded to 8; the naive engine is finite, so the fused one must be too."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=9, labels=5, channels=2, rank=3, topology=topology, gamma=2, global_labels=3)
    crf = crf.to(dtype)
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(potential)
    tokens = torch.randint(0, 9, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 3:], mask[2, 1:] = False, False
    results = {}
    for kernel in ("naive", "fused"):
        crf.zero_grad()
        post = MeanField(crf, iterations=3, kernel=kernel, weights="reference")(tokens, mask)
        (post.logits.float().sum() + post.elbo.float().sum()).backward()
        results[kernel] = [post.logits, post.elbo, *(p.grad for p in crf.parameters())]
    assert all(torch.isfinite(t).all() for t in results["naive"])
    assert all(torch.isfinite(t).all() for t in results["fused"])
    if dtype == torch.float64 and potential == 10.0:  # well conditioned: the engines agree
        for a, b in zip(results["naive"], results["fused"]):
            torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-8)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    potential=st.sampled_from([1.0, 10.0, 100.0, 1e3, 1e4]),
    topology=st.sampled_from(["full", "causal", "star()", "window(1)"]),
    gamma=st.integers(0, 2),
    n=st.integers(1, 4),
)
def test_fused_float32_matches_float64_naive_at_large_potentials(seed, potential, topology, gamma, n):
    """The last silent-wrong cases: tied heads (repeated tokens) at |score| ~ 1e4..1e8
    lost their log 2 in float32 log-space merges. The float64 naive engine on a float64
    copy is the reference; the float32 fused engine must agree as closely as float32 naive."""
    gen = torch.Generator().manual_seed(seed)
    crf = graphs.CRF(vocab_size=3, labels=3, channels=2, rank=2, topology=topology, gamma=gamma)
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * potential)
    tokens = torch.randint(0, 3, (2, n + 2), generator=gen)  # few token ids: many ties
    mask = torch.ones(2, n + 2, dtype=torch.bool)
    mask[1, n:] = False
    with torch.no_grad():
        fused = MeanField(crf, iterations=3, kernel="fused")(tokens, mask).logits
        reference = MeanField(copy.deepcopy(crf).double(), iterations=3, kernel="naive")(tokens, mask).logits
    relative = ((fused.double() - reference).abs() / (1 + reference.abs())).max()
    assert fused.dtype == torch.float32 and relative <= 1e-3


def test_fused_precision_follows_the_parameters_without_a_sync_per_forward():
    """The score bound is read (a host sync) at construction and then only when a parameter
    changed: a read in each forward of a fixed model would be a sync per forward."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=5, labels=4, channels=2, rank=3, gamma=1)
    engine = MeanField(crf, iterations=2, kernel="fused")
    tokens = torch.randint(0, 5, (2, 6))
    calls = []
    bound = head_kernels.score_bound

    def counting(*args):
        calls.append(1)
        return bound(*args)

    with mock.patch.object(head_kernels, "score_bound", counting), torch.no_grad():
        engine(tokens)
        engine(tokens)
        assert len(calls) == 0 and engine.fused_compute_dtype(1.0) is None  # read once, at construction
        u, v = crf.ternary_u.clone(), crf.ternary_v.clone()
        assert engine.fused_compute_dtype(1.0) is None  # max |U_a| max |V_b| <= 512: float32
        for p in crf.parameters():
            p.mul_(1e2)  # an in-place change outside any optimiser: the version counter sees it
        engine(tokens)
        assert len(calls) == 1
    with torch.no_grad():
        bound_now = float(head_kernels.score_bound(crf.ternary_u, crf.ternary_v))
    expected = (u.norm(dim=-1).amax(-1) * v.norm(dim=-1).amax(-1)).max() * 1e4
    assert bound_now == pytest.approx(float(expected), rel=1e-5)
    assert engine.fused_compute_dtype(1.0) == torch.float64


# ---- Exact ------------------------------------------------------------------------


@st.composite
def scaled_crfs(draw):
    topology = draw(st.sampled_from(["full", "causal", "window(1)", "star()", "clusters(1)", "segments(2)"]))
    n = draw(st.integers(1, 3))
    crf = graphs.CRF(
        vocab_size=4,
        labels=2,
        channels=1,
        rank=2,
        global_labels=draw(st.sampled_from([0, 2])),
        topology=topology,
        gamma=draw(st.integers(0, 2)),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    potential = draw(st.sampled_from([1.0, 10.0, 100.0, 1e3, 1e4]))
    with torch.no_grad():
        for p in crf.parameters():  # float32 parameters of +-potential
            p.copy_(torch.randn(p.shape, generator=gen) * potential)
    tokens = torch.randint(0, 4, (2, n), generator=gen)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, draw(st.integers(1, n)) :] = False
    return crf, tokens, mask


def enumerated_log_z(crf, tokens, mask):
    """log Z of each sentence by a float64 log-sum-exp over every assignment (the oracle
    builds its own float64 tables from the parameters)."""
    return [oracles.full_enumeration_log_z(crf, tokens[b].tolist(), mask[b].tolist()) for b in range(len(tokens))]


@settings(max_examples=60, deadline=None)
@given(data=scaled_crfs())
def test_exact_log_partition_is_float64_and_right_at_extreme_potentials(data):
    crf, tokens, mask = data
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
    assert log_z.dtype == torch.float64
    for found, expected in zip(log_z.tolist(), enumerated_log_z(crf, tokens, mask)):
        assert found == pytest.approx(expected, rel=1e-10, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(data=scaled_crfs())
def test_mean_field_elbo_stays_below_exact_log_partition_at_extreme_potentials(data):
    crf, tokens, mask = data
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
        elbo32 = MeanField(crf, iterations=20, schedule="sequential")(tokens, mask).elbo
        elbo64 = MeanField(crf.double(), iterations=20, schedule="sequential")(tokens, mask).elbo
    assert torch.isfinite(log_z).all()
    # the float64 ELBO to float64 rounding; the float32 one to its own rounding (at large
    # potentials mean field is nearly exact, so it sits within rounding of log Z)
    assert (elbo64 <= log_z + 1e-9 * log_z.abs().clamp_min(1)).all(), (elbo64, log_z)
    assert (elbo32.double() <= log_z + 1e-5 * log_z.abs().clamp_min(1)).all(), (elbo32, log_z)


def enumerated_label_marginals(crf, tokens):
    """log Z and ``[N, d]`` label marginals of one unpadded sentence ``[1, n]``: every joint
    assignment (z, h, g) scored by ``crf.log_potential`` in float64, then log-sum-exp."""
    crf = copy.deepcopy(crf).double()
    n = tokens.shape[1]
    N, C, G = crf.topology.num_nodes(n), crf.channels, crf.global_labels
    arcs = crf.arc_mask(torch.ones(1, n, dtype=torch.bool))[0]
    heads = [arcs[i].nonzero().flatten().tolist() or [0] for i in range(N)]
    zs = torch.tensor(list(itertools.product(range(crf.labels), repeat=N)))
    hs = torch.tensor(list(itertools.product(*(heads * C)))).view(-1, C, N)
    gs = torch.tensor(list(itertools.product(range(G), repeat=n))) if G else torch.zeros(1, 0, dtype=torch.long)
    z = zs.repeat_interleave(len(hs) * len(gs), 0)
    h = hs.repeat_interleave(len(gs), 0).repeat(len(zs), 1, 1)
    g = gs.repeat(len(zs) * len(hs), 1) if G else None
    with torch.no_grad():
        scores = crf.log_potential(tokens.expand(len(z), n), z, h, g)
    log_z = scores.logsumexp(0)
    weights = (scores - log_z).exp()
    marginals = torch.zeros(N, crf.labels, dtype=torch.float64)
    for i in range(N):
        marginals[i].index_add_(0, z[:, i], weights)
    return log_z.item(), marginals


@pytest.mark.parametrize("potential", [1.0, 100.0, 1e4])
@pytest.mark.parametrize("topology", ["star()", "window(1)"])
def test_exact_marginals_at_extreme_potentials_equal_enumeration(potential, topology):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=4, labels=2, channels=1, rank=2, global_labels=2, topology=topology)
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(potential)
    tokens = torch.tensor([[0, 3, 1]])
    with torch.no_grad():
        post = inference.Exact(crf).marginals(tokens)
    assert post.z.dtype == torch.float32 and post.log_partition.dtype == torch.float32  # the CRF's dtype
    log_z, z = enumerated_label_marginals(crf, tokens)
    with torch.no_grad():
        wide = inference.Exact(crf).log_partition(tokens)  # the float64 value the Posterior's is cast from
    assert wide.dtype == torch.float64 and wide[0].item() == pytest.approx(log_z, rel=1e-10)
    assert post.log_partition[0].item() == pytest.approx(log_z, rel=1e-6)
    torch.testing.assert_close(post.z[0].double(), z, atol=1e-6, rtol=0)  # float32 probabilities


def test_exact_refuses_bad_arguments_clearly():
    with pytest.raises(TypeError, match="crf must be a graphs.CRF, got NoneType"):
        inference.Exact(None)
    crf = graphs.CRF(vocab_size=4, labels=2)
    for bad in ("x", 2.5, True, 0):
        with pytest.raises(ValueError, match="max_configurations must be >= 1"):
            inference.Exact(crf, max_configurations=bad)


def _explicit_null_softmax(logits, has_head):
    """The definition: softmax and logsumexp over the logits with a null column appended (0
    where the row has no head, -inf where it has)."""
    B, C, n, _ = logits.shape
    null = torch.where(has_head, -math.inf, 0.0).to(logits.dtype)[:, None, :, None].expand(B, C, n, 1)
    extended = torch.cat([logits, null], -1)
    return extended.softmax(-1)[..., :-1], extended.logsumexp(-1)


def _assert_grads_close(mine, true, rtol, atol):
    for tensor, expected in zip(mine, true):
        if tensor is None:
            continue
        got = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
        want = expected.grad if expected.grad is not None else torch.zeros_like(got)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# random head-logit problems: sentences of n nodes, logits up to ~scale, a share of illegal arcs
HEAD_PROBLEMS = dict(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 9),
    scale=st.sampled_from([1.0, 30.0, 1e3]),
    illegal=st.floats(0.0, 0.9),
)


def _weighted_loss(results, names, weights, outputs):
    """A random linear function of the outputs named in ``outputs`` (their gradients then test
    every one of them alone and together)."""
    return sum((x * w).sum() for name, x, w in zip(names, results, weights) if name in outputs)


def _assert_outputs_close(results, expected, rtol, atol):
    for result, true in zip(results, expected):
        torch.testing.assert_close(result, true, rtol=rtol, atol=atol)


@settings(max_examples=60, deadline=None)
@given(**HEAD_PROBLEMS, outputs=st.sets(st.sampled_from(["probs", "lse"]), min_size=1))
def test_null_softmax_equals_a_softmax_over_an_explicit_null_column(seed, n, scale, illegal, outputs):
    """The naive kernel's head distribution (the null logit 0 never materialised, backward
    written out) against the definition; values and gradients of either output, float64."""
    from inference.mean_field.kernels.null_softmax import softmax_with_null

    generator = torch.Generator().manual_seed(seed)
    B, C = 2, 3
    logits = scale * torch.randn(B, C, n, n, generator=generator, dtype=torch.float64)
    legal = torch.rand(B, 1, n, n, generator=generator) >= illegal
    has_head = legal[:, 0].any(-1)
    logits = logits.masked_fill(~legal, -math.inf)
    names = ["probs", "lse"]
    weights = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in [(B, C, n, n), (B, C, n)]]
    true_logits, mine = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    expected = _explicit_null_softmax(true_logits, has_head)
    _weighted_loss(expected, names, weights, outputs).backward()
    results = softmax_with_null(mine, has_head)
    _weighted_loss(results, names, weights, outputs).backward()
    _assert_outputs_close(results, expected, rtol=1e-12, atol=1e-13)
    _assert_grads_close([mine], [true_logits], rtol=1e-9, atol=1e-12)
    with torch.no_grad():  # the no-grad path is the same forward
        _assert_outputs_close(softmax_with_null(logits, has_head), expected, rtol=1e-12, atol=1e-13)


@settings(max_examples=60, deadline=None)
@given(
    **HEAD_PROBLEMS,
    additive=st.booleans(),
    outputs=st.sets(st.sampled_from(["probs", "lse", "forward", "reverse"]), min_size=1),
)
def test_shared_heads_equal_the_definition(seed, n, scale, illegal, additive, outputs):
    """The shared form's kernel (one sentence at a time, logits in log2 units, backward
    written out) against the definition written with plain operators: logits scale q_i . k_j
    + additive[c, i, j] on the legal arcs, the softmax over them and a null column, the
    messages P V and P^T V_rev; values and gradients of any subset of the outputs, float64.
    (The log2 scaling rounds the logits once more: rtol 1e-10 at logits ~1e3.)"""
    from inference.mean_field.kernels.shared_heads import shared_heads

    generator = torch.Generator().manual_seed(seed)
    B, C, r = 2, 3, 4
    projections = [torch.randn(B, n, C, r, generator=generator, dtype=torch.float64) for _ in range(4)]
    bias = torch.randn(C, n, n, generator=generator, dtype=torch.float64) if additive else None
    arcs = torch.rand(B, n, n, generator=generator) >= illegal
    names = ["probs", "lse", "forward", "reverse"]
    shapes = [(B, C, n, n), (B, C, n), (B, n, C, r), (B, n, C, r)]
    weights = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]

    def truth(query, key, bias, value, value_rev):
        logits = scale * torch.einsum("bicr,bjcr->bcij", query, key)
        logits = logits if bias is None else logits + bias
        probs, lse = _explicit_null_softmax(logits.masked_fill(~arcs[:, None], -math.inf), arcs.any(-1))
        forward = torch.einsum("bcij,bjcr->bicr", probs, value)
        return probs, lse, forward, torch.einsum("bcji,bjcr->bicr", probs, value_rev)

    def leaves():
        return [None if t is None else t.clone().requires_grad_() for t in (*projections[:2], bias, *projections[2:])]

    true_inputs, mine = leaves(), leaves()
    expected = truth(*true_inputs)
    _weighted_loss(expected, names, weights, outputs).backward()
    query, key, additive_bias, value, value_rev = mine
    results = shared_heads(query, key, scale, additive_bias, arcs, value, value_rev)
    _weighted_loss(results, names, weights, outputs).backward()
    _assert_outputs_close(results, expected, rtol=1e-10, atol=1e-12)
    _assert_grads_close(mine, true_inputs, rtol=1e-9, atol=1e-11)
    with torch.no_grad():  # the no-grad path is the same forward
        again = shared_heads(*projections[:2], scale, bias, arcs, *projections[2:])
    _assert_outputs_close(again, expected, rtol=1e-10, atol=1e-12)


def test_shared_heads_refuses_a_tensor_scale_and_a_second_derivative():
    """The scale is a constant of the kernel (a tensor would silently get no gradient), and
    the written-out backward is differentiable once: both refused by name."""
    from inference.mean_field.kernels.shared_heads import shared_heads

    q, k, v, vr = (torch.randn(1, 3, 2, 2, dtype=torch.float64, requires_grad=True) for _ in range(4))
    arcs = torch.ones(1, 3, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="scale must be a Python number"):
        shared_heads(q, k, torch.tensor(0.5), None, arcs, v, vr)
    lse = shared_heads(q, k, 0.5, None, arcs, v, vr)[1]
    (grad,) = torch.autograd.grad(lse.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        torch.autograd.grad(grad.sum(), k)
