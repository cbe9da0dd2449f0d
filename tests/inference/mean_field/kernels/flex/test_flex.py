"""The flex_attention head kernel (inference.mean_field.kernels.flex) against the naive kernel and a
dense reference written here, in values and gradients.

On the CPU the kernel runs flex_attention's eager reference, which reads only the block
masks' mask_mod: the block metadata the compiled CUDA kernel walks (partial / full blocks,
and their transposes for the backward) is checked separately against the dense arcs. The
CUDA class runs the compiled kernel itself where a device is present.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
from inference.mean_field import engine as mean_field
from inference.mean_field.kernels import flex as flex_kernel
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.flex import flex
from inference.mean_field.kernels.head_kernels import HeadStructure
from tests.builders import flex_batch as batch
from tests.oracles import dense_attention_reference as reference

pytestmark = pytest.mark.usefixtures("one_thread")


TOPOLOGIES = ["full", "causal", "window(2)", "chain()", "full | root()"]


# gamma as an integer, or distance buckets' cut points
BUCKETS = [0, 1, 3, [2, 4], [3], []]


def outputs_and_gradients(kernel, projections, scale, structure, bias=None, **options):
    """Messages, lse and the gradients of a fixed random function of them (w.r.t. the
    projections and the bias)."""
    leaves = [p.detach().clone().requires_grad_() for p in projections]
    extra = {} if bias is None else {"bias": bias.detach().clone().requires_grad_()}
    result = kernel(*leaves, scale, structure, **extra, **options)
    forward, reverse, lse = (result.forward, result.reverse, result.lse) if hasattr(result, "lse") else result
    generator = torch.Generator().manual_seed(1)
    directions = [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t) for t in (forward, reverse, lse)]
    loss = sum((t * d).sum() for t, d in zip((forward, reverse, lse), directions))
    gradients = torch.autograd.grad(loss, leaves + list(extra.values()))
    return [forward, reverse, lse, *gradients]


def assert_all_close(ours, theirs, atol, rtol):
    for a, b in zip(ours, theirs, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.to(b), b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("buckets", BUCKETS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_flex_equals_naive_in_values_and_gradients(topology, buckets):
    structure, projections = batch(topology, buckets, n=11)
    naive = outputs_and_gradients(head_kernels.naive, projections, 0.7, structure)
    ours = outputs_and_gradients(flex, projections, 0.7, structure)
    assert_all_close(ours, naive, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_flex_with_a_score_bias_equals_the_dense_reference(topology, shared):
    structure, projections = batch(topology, [2, 4], n=9)
    bias = 2 * torch.randn(projections[0].shape[2], projections[0].shape[3], dtype=torch.float64)
    if shared:  # one projection for every group (graphs.ternary's shared form)
        projections = [p[:, :, :1] for p in projections]
    expected = outputs_and_gradients(reference, projections, 1.3, structure, bias)
    ours = outputs_and_gradients(flex, projections, 1.3, structure, bias)
    assert_all_close(ours, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("shared", [False, True])
def test_the_dense_reference_is_the_naive_kernel(shared):
    """The test's own reference agrees with the library's naive kernel."""
    structure, projections = batch("full | root()", 2, n=7)
    bias = torch.randn(projections[0].shape[2], projections[0].shape[3], dtype=torch.float64)
    if shared:
        projections = [p[:, :, :1] for p in projections]
    expected = outputs_and_gradients(head_kernels.naive, projections, 0.9, structure, bias)
    assert_all_close(outputs_and_gradients(reference, projections, 0.9, structure, bias), expected, 1e-12, 1e-12)


def test_flex_at_length_40_in_float32():
    structure, projections = batch("full | root()", 3, n=40, channels=3)
    naive = outputs_and_gradients(head_kernels.naive, projections, 0.5, structure)
    ours = outputs_and_gradients(flex, [p.float() for p in projections], 0.5, structure)
    scale = max(float(t.detach().abs().max()) for t in naive)
    assert_all_close(ours, naive, atol=1e-5 * scale, rtol=1e-4)


def test_rows_without_a_head_get_zero_messages_and_lse_zero():
    structure, projections = batch("causal", 1, n=6)  # row 0 and padded rows have no head
    leaves = [p.clone().requires_grad_() for p in projections]
    result = flex(*leaves, 2.0, structure)
    no_head = ~structure.has_head  # [B, N]
    assert no_head[:, 0].all() and no_head[1, 3:].all()
    assert (result.lse.transpose(1, 2)[no_head] == 0).all()
    assert (result.forward[no_head] == 0).all()
    (result.forward.sum() + result.reverse.sum() + result.lse.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in leaves)


def test_lse_only_equals_the_lse_of_the_messages():
    structure, projections = batch("window(2)", [3], n=10)
    full = flex(*projections, 1.1, structure)
    alone = flex(*projections, 1.1, structure, messages=False)
    assert alone.forward is None and alone.reverse is None
    torch.testing.assert_close(alone.lse, full.lse, atol=0, rtol=0)


def test_half_precision_inputs_are_computed_in_float32():
    structure, projections = batch("full", 1, n=8)
    result = flex(*(p.to(torch.bfloat16) for p in projections), 1.0, structure)
    wide = flex(*(p.to(torch.bfloat16).float() for p in projections), 1.0, structure)
    assert result.forward.dtype == torch.bfloat16
    torch.testing.assert_close(result.forward, wide.forward.to(torch.bfloat16), atol=0, rtol=0)


def test_bad_arguments_are_refused():
    structure, projections = batch("full", 1, n=4)
    with pytest.raises(ValueError, match=r"bias must have shape \[K, C\]"):
        flex(*projections, 1.0, structure, bias=torch.zeros(2))
    with pytest.raises(ValueError, match="query must have a group axis of 1 or K"):
        flex(*(p[:, :, :2] for p in projections), 1.0, structure)
    structure.prior = torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="no head prior"):
        flex(*projections, 1.0, structure)


@settings(max_examples=30)
@given(
    topology=st.sampled_from(TOPOLOGIES + ["window(1) | star()", "clusters(2)", "segments(3, causal=True)"]),
    buckets=st.sampled_from(BUCKETS),
    n=st.integers(1, 16),
    channels=st.integers(1, 3),
    scale=st.sampled_from([0.0, 0.3, 1.0, -2.0]),
    with_bias=st.booleans(),
    shared=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_flex_equals_the_dense_reference_on_random_structures(
    topology, buckets, n, channels, scale, with_bias, shared, seed
):
    structure, projections = batch(topology, buckets, n, channels, seed)
    bias = torch.randn(projections[0].shape[2], channels, dtype=torch.float64) if with_bias else None
    if shared:  # one projection for every group
        projections = [p[:, :, :1] for p in projections]
    expected = outputs_and_gradients(reference, projections, scale, structure, bias)
    assert_all_close(outputs_and_gradients(flex, projections, scale, structure, bias), expected, 1e-10, 1e-10)


def test_flex_traces_into_one_graph_and_equals_eager():
    """torch.compile(fullgraph=True) of the whole kernel, block masks included (what a compiled
    model on CUDA needs). On the CPU inductor's flex kernel returns no lse and has no
    backward, so this traces with aot_eager: the graph, not the CPU code generation."""
    structure, projections = batch("full | root()", [2, 4], n=12)
    bias = torch.randn(projections[0].shape[2], projections[0].shape[3], dtype=torch.float64)
    eager = outputs_and_gradients(flex, projections, 0.5, structure, bias)
    torch._dynamo.reset()
    compiled = torch.compile(flex, backend="aot_eager", fullgraph=True)
    ours = outputs_and_gradients(compiled, projections, 0.5, structure, bias)
    assert_all_close(ours[:3], eager[:3], 1e-12, 1e-12)  # values: the same float64 arithmetic
    # the traced backward of flex's reference carries the lse gradient in float32 (measured:
    # ~1e-6 off in the query, key and bias gradients, value gradients exact)
    scale = max(float(t.abs().max()) for t in eager[3:])
    assert_all_close(ours[3:], eager[3:], atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("form", ["low_rank", "shared"])
@pytest.mark.parametrize("topology", ["causal", "full | root()"])
def test_mean_field_with_flex_equals_naive(topology, form, monkeypatch):
    """The whole engine: logits, ELBO and parameter gradients, with padding."""
    torch.manual_seed(0)
    options = dict(vocab_size=9, labels=4, channels=2, rank=3, global_labels=2, topology=topology, gamma=[2, 4])
    crf = graphs.CRF(**options, **({"ternary_form": "shared"} if form == "shared" else {})).double()
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(3.0)
    tokens = torch.randint(0, 9, (2, 10))
    mask = torch.arange(10)[None] < torch.tensor([[10], [6]])
    results = {}
    # the engine refuses to train with flex on the CPU (test_flex_refuses_training_on_the_cpu);
    # its eager reference is differentiable, which this comparison needs
    monkeypatch.setattr(flex_kernel, "flex_available", lambda device: True)
    for kernel in ("naive", "flex"):
        crf.zero_grad()
        post = mean_field.MeanField(crf, iterations=3, kernel=kernel, weights="reference")(tokens, mask)
        (post.logits.square().sum() + post.elbo.sum()).backward()
        results[kernel] = [post.logits.detach(), post.elbo.detach(), *(p.grad.clone() for p in crf.parameters())]
    assert_all_close(results["flex"], results["naive"], atol=1e-9, rtol=1e-9)


def test_head_dimensions_padded_to_a_power_of_two_where_torch_wants_one(monkeypatch):
    """Releases whose flex_attention accepts only powers of two (r + 1 = 4 here -> 16, and 17
    -> 32): the zero padding leaves messages, lse and gradients as the naive kernel's."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_supported_head_dim", lambda width: width & (width - 1) == 0, raising=False)
    assert [flex_kernel._head_dim(w) for w in (3, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]
    structure, projections = batch("full | root()", 1, n=9)
    projections = [torch.cat([p] * 6, -1) for p in projections]  # r = 18: q, k of the reverse 19 -> 32
    naive = outputs_and_gradients(head_kernels.naive, projections, 0.3, structure)
    assert_all_close(outputs_and_gradients(flex, projections, 0.3, structure), naive, 1e-10, 1e-10)


def test_flex_refuses_training_on_the_cpu_and_runs_without_gradients():
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=9, labels=4, channels=2, rank=3, topology="causal").double()
    tokens = torch.randint(0, 9, (2, 7))
    engine = mean_field.MeanField(crf, iterations=2, kernel="flex")
    with pytest.raises(ValueError, match="kernel='flex' cannot train on 'cpu'.*kernel='fused'"):
        engine(tokens)
    with torch.no_grad():
        flex_logits = engine(tokens).logits
        naive_logits = mean_field.MeanField(crf, iterations=2, kernel="naive")(tokens).logits
    torch.testing.assert_close(flex_logits, naive_logits, atol=1e-10, rtol=1e-10)


def test_flex_equals_naive_across_several_blocks():
    structure, projections = batch("full | root()", [2, 130], n=150, channels=1)
    projections = [p[:2] for p in projections]
    structure.arcs, structure.nodes = structure.arcs[:2], structure.nodes[:2]
    naive = outputs_and_gradients(head_kernels.naive, projections, 0.2, structure)
    assert_all_close(outputs_and_gradients(flex, projections, 0.2, structure), naive, 1e-10, 1e-10)


def test_float32_dot_products_on_cuda_are_three_tf32_products(monkeypatch):
    """Triton's "ieee" float32 dot runs without tensor cores (docs/benchmarks.md, GPU check);
    "tf32x3" keeps float32's precision (the CUDA tests below hold it to the fused kernel's),
    where plain "tf32" rounds every input to 10 mantissa bits. The CPU path passes no such option."""
    cuda = flex_kernel._kernel_options(torch.device("cuda"))
    assert cuda["FLOAT32_PRECISION"] == "'tf32x3'" and cuda["BACKEND"] == "TRITON"
    assert "FLOAT32_PRECISION" not in flex_kernel._kernel_options(torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.0")  # ROCm: torch's own choice stands
    assert "FLOAT32_PRECISION" not in flex_kernel._kernel_options(torch.device("cuda"))


# ---- CUDA: the compiled kernel ------------------------------------------------------


NO_CUDA = "no CUDA device: the flex kernel's CUDA run is not tested here"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
class TestCuda:
    """The compiled (Triton) kernel against the naive kernel in float64 on the CPU."""

    # one bucket choice per topology: each (topology, buckets) pair is a configuration of its
    # own (a Triton compile of tens of seconds), and the GPU check runs these in one budget
    @pytest.mark.parametrize(
        "topology, buckets",
        [("full", 3), ("causal", [2, 4]), ("window(2)", 0), ("chain()", 1), ("full | root()", [2, 4]),
         ("segments(3, causal=True)", 1), ("window(1) | clusters(2)", 1)],
    )  # fmt: skip
    def test_compiled_flex_equals_naive(self, topology, buckets):
        self.compare(topology, buckets, n=37)

    @pytest.mark.parametrize("topology", ["full | root()", "causal"])
    def test_compiled_flex_equals_naive_across_blocks(self, topology):
        self.compare(topology, [2, 130], n=300)

    def test_flex_under_bf16_autocast_computes_in_float32(self):
        from tests.builders import head_kernel_problem as problem
        from tests.oracles import dense_head_messages as dense
        from tests.oracles import relative_errors

        structure, projections = problem("flex")
        expected = dense(*projections, 1.0, structure)
        fused = relative_errors(head_kernels.fused(*projections, 1.0, structure), expected)
        cuda_structure = HeadStructure(n=structure.n, gamma=structure.gamma, nodes=structure.nodes.cuda(),
                                       token_arcs=structure.token_arcs.cuda(), arcs=structure.arcs.cuda(),
                                       band=structure.band)  # fmt: skip
        with torch.autocast("cuda", dtype=torch.bfloat16):
            result = flex(*(p.cuda() for p in projections), 1.0, cuda_structure)
        assert result.forward.dtype == torch.float32
        for ours, theirs in zip(relative_errors(result, [t.cuda() for t in expected]), fused):
            assert ours <= max(4 * theirs, 1e-4), (ours, theirs)  # unguarded bf16: ~1 (tests/inference)

    def test_float64_engine_on_cuda_runs_the_fused_kernel_and_equals_naive(self):
        torch.manual_seed(0)
        crf = graphs.CRF(vocab_size=9, labels=4, channels=2, rank=3, topology="full | root()", gamma=1).double()
        tokens = torch.randint(0, 9, (2, 10))
        expected = mean_field.MeanField(crf, iterations=2, kernel="naive")(tokens).logits
        engine = mean_field.MeanField(crf, iterations=2, kernel="flex").cuda()
        torch.testing.assert_close(engine(tokens.cuda()).logits.cpu(), expected, atol=1e-10, rtol=1e-10)

    def test_the_score_bound_is_read_without_a_host_sync(self):
        crf = graphs.CRF(vocab_size=9, labels=4, channels=2, rank=3).cuda()
        engine = mean_field.MeanField(crf, kernel="flex")
        assert engine.fused_compute_dtype(1.0) is None
        with torch.no_grad():
            for p in crf.parameters():
                p.mul_(1e3)  # scores far past the float32 bound
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.fused_compute_dtype(1.0)  # sends the new bound, reads nothing back
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert engine.fused_compute_dtype(1.0) == torch.float64  # arrived

    @pytest.mark.parametrize("shared", [False, True])
    def test_compiled_flex_with_a_score_bias_and_inside_torch_compile(self, shared):
        structure, projections = batch("full | root()", 2, n=50)
        bias = torch.randn(projections[0].shape[2], 2, dtype=torch.float64)
        slots = slice(0, 1) if shared else slice(None)  # shared: flex's grouped-query attention
        expected = outputs_and_gradients(reference, [p[:, :, slots] for p in projections], 0.5, structure, bias)
        cuda_structure, cuda_projections = batch("full | root()", 2, n=50, device="cuda")
        cuda_projections = [p[:, :, slots].float() for p in cuda_projections]
        compiled = torch.compile(flex)
        for kernel in (flex, compiled):
            ours = outputs_and_gradients(kernel, cuda_projections, 0.5, cuda_structure, bias.float().cuda())
            scale = max(float(t.detach().abs().max()) for t in expected)
            assert_all_close([t.cpu() for t in ours], expected, atol=1e-5 * scale, rtol=1e-4)

    def compare(self, topology, buckets, n):
        structure, projections = batch(topology, buckets, n)
        naive = outputs_and_gradients(head_kernels.naive, projections, 0.5, structure)
        cuda_structure, cuda_projections = batch(topology, buckets, n, device="cuda")
        ours = outputs_and_gradients(flex, [p.float() for p in cuda_projections], 0.5, cuda_structure)
        scale = max(float(t.detach().abs().max()) for t in naive)
        assert_all_close([t.cpu() for t in ours], naive, atol=1e-5 * scale, rtol=1e-4)
