"""The head kernels (inference.mean_field.kernels.head_kernels) at extreme inputs and at length:
no silent NaN or wrong number (the naive kernel in float64 as the oracle), precision that
follows the parameters without a sync, and no allocation of N^2 elements (a dispatch mode
records every allocation of a forward and backward at n = 4096; the naive kernel is the
positive control)."""

import copy
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import graphs
from inference.mean_field.engine import MeanField
from inference.mean_field.kernels import flex as flex_kernel
from inference.mean_field.kernels import head_kernels
from tests.builders import head_structure_of as structure_of

pytestmark = pytest.mark.usefixtures("one_thread", "keep_global_rng")


N_TOKENS = 4096


FUSED_TOPOLOGIES = ["full", "causal", "window(16)", "segments(256)", "full | root()", "star()", "clusters(4)"]


class Allocations(TorchDispatchMode):
    """The element count (and the bytes) of every new storage an operator returns, with the operator."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, str]] = []
        self.bytes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _dense(t)}
        for out in tree_flatten(result)[0]:
            if _dense(out) and out.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((out.untyped_storage().nbytes() // out.element_size(), str(func)))
                self.bytes.append((out.untyped_storage().nbytes(), str(func)))
        return result

    def largest(self) -> tuple[int, str]:
        return max(self.sizes, default=(0, ""))

    def largest_bytes(self) -> tuple[int, str]:
        return max(self.bytes, default=(0, ""))


def _dense(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def engine_run(topology: str, kernel: str, n: int, grad: bool = True):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=11, labels=4, channels=2, rank=4, topology=topology, gamma=1)
    engine = MeanField(crf, iterations=1, kernel=kernel)
    tokens = torch.randint(0, 11, (2, n))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - 100 :] = False  # padding: the rows' nodes differ

    def run():
        with torch.set_grad_enabled(grad):
            post = engine(tokens, mask)
            if grad:
                post.logits.square().sum().backward()

    def warm_up():  # the caches kept per (topology, n, device): the token table, its float copy
        assert engine.structure(tokens, mask)[2].has_head.any()

    run.warm_up = warm_up
    return crf, run


@pytest.mark.parametrize("topology", FUSED_TOPOLOGIES)
def test_the_fused_engine_allocates_nothing_quadratic(topology):
    crf, run = engine_run(topology, "fused", N_TOKENS)
    run.warm_up()
    with Allocations() as allocations:
        run()
    N = crf.topology.num_nodes(N_TOKENS)
    largest, operator = allocations.largest()
    assert largest < N * N, f"{operator} allocated {largest} elements (N^2 = {N * N})"
    assert largest > 0


@pytest.mark.parametrize("topology", ["star(wrap=True)", "window(1) | star(wrap=True)"])
def test_the_fused_engine_on_a_topology_of_the_sentence_length_allocates_no_more_than_its_arcs(topology):
    """Each row's own token table: the batch's arcs ``[B, N, N]`` bool are the largest
    allocation (B = 2), in bytes: never the naive kernel's ``[B, C, N, N]``, nor a float
    ``[B, N, N]`` (as many elements as the arcs, four times their bytes)."""
    n = 1024
    crf, run = engine_run(topology, "fused", n)
    with Allocations() as allocations:
        run()
    N = crf.topology.num_nodes(n)
    largest, operator = allocations.largest_bytes()
    assert N * N < largest <= 2 * N * N, f"{operator} allocated {largest} bytes (the bool arcs: {2 * N * N})"


@pytest.mark.parametrize("topology", ["causal | root()", "segments(64)", "window(8) | clusters(4)"])
def test_the_flex_kernel_allocates_nothing_quadratic_around_the_attention(topology, monkeypatch):
    reference = flex_kernel._flex_reference
    calls = []

    def unrecorded(*args, **kwargs):  # the eager reference's own scores are left out
        calls.append(1)
        with _disable_current_modes():
            return reference(*args, **kwargs)

    monkeypatch.setattr(flex_kernel, "_flex_reference", unrecorded)
    n = 512  # the eager reference materialises [B, C K, N, N] scores: a smaller n keeps it quick
    crf, run = engine_run(topology, "flex", n, grad=False)
    run()
    with Allocations() as recorder:
        run()
    assert calls  # the kernel ran through the (unrecorded) attention
    N = crf.topology.num_nodes(n)
    largest, operator = recorder.largest()
    assert 0 < largest < N * N, f"{operator} allocated {largest} elements (N^2 = {N * N})"


def test_the_naive_kernel_is_caught():
    """Positive control: the recorder sees the materialised head marginals."""
    n = 256
    crf, run = engine_run("full", "naive", n)
    with Allocations() as allocations:
        run()
    assert allocations.largest()[0] >= 2 * crf.channels * n * n


TOPOLOGIES = [
    "full",
    "causal",
    "window(1)",
    "window(4)",
    "star()",
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
