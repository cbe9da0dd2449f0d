"""MeanField (inference.mean_field.engine): the ELBO bounds log Z, converged marginals satisfy
the update equations, the fused kernel equals the naive one, and the reference algorithm's
damping, step sizes and distance buckets are reproduced."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from inference import MeanField
from tests import oracles
from tests.reference_pt import reference_logits
from tests.strategies import tiny_crfs

WEIGHTS = st.sampled_from(["crf", "reference"])


def double(crf):
    return crf.double()


@settings(max_examples=220)
@given(
    data=tiny_crfs(),
    schedule=st.sampled_from(["async", "parallel", "sequential"]),
    weights=WEIGHTS,
    mup=st.booleans(),
    iterations=st.integers(1, 4),
)
def test_elbo_is_a_lower_bound_on_log_partition(data, schedule, weights, mup, iterations):
    crf, tokens, mask = data
    crf = double(crf)
    with torch.no_grad():
        post = MeanField(crf, iterations=iterations, schedule=schedule, mup=mup, weights=weights)(tokens, mask)
        log_z = inference.Exact(crf).log_partition(tokens, mask)
    kl = log_z - post.elbo
    assert torch.isfinite(post.elbo).all()
    assert (kl >= -1e-9).all(), kl
    # the reported number is the ELBO of the returned labels (heads, globals optimal given them)
    for b in range(tokens.shape[0]):
        expected = oracles.mean_field_elbo(crf, tokens[b].tolist(), mask[b].tolist(), post.z[b])
        assert post.elbo[b].item() == pytest.approx(expected, abs=1e-8)
    assert post.trace["elbo"].shape == (iterations, tokens.shape[0])


@settings(max_examples=40)
@given(data=tiny_crfs())
def test_sequential_schedule_never_decreases_the_elbo(data):
    crf, tokens, mask = data
    crf = double(crf)
    with torch.no_grad():
        post = MeanField(crf, iterations=3, schedule="sequential")(tokens, mask)
    steps = post.trace["elbo_steps"]  # [steps, B]
    assert (steps.diff(dim=0) >= -1e-10).all()
    assert (post.trace["elbo"].diff(dim=0) >= -1e-10).all()


@pytest.mark.parametrize("topology", ["full", "causal", "window(1) | star()", "clusters(2)", "segments(2)"])
@pytest.mark.parametrize("schedule", ["sequential", "async"])
@pytest.mark.parametrize("rank", [2, 5])  # 5: above the 3 labels, computed at rank 3
def test_converged_marginals_satisfy_the_update_equations(topology, schedule, rank):
    torch.manual_seed(3)
    crf = graphs.CRF(vocab_size=6, labels=3, channels=2, rank=rank, global_labels=2, topology=topology).double()
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(0.5)  # a contraction: the fixed point is unique and reached
    tokens = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    with torch.no_grad():
        post = MeanField(crf, iterations=60, schedule=schedule)(tokens, mask)
    assert post.trace["max_delta"][-1].max() < 1e-10
    for b in range(2):
        update = oracles.mean_field_update(crf, tokens[b].tolist(), mask[b].tolist(), post.z[b])
        torch.testing.assert_close(post.z[b], update, atol=1e-9, rtol=0)


@settings(max_examples=60)
@given(
    n=st.integers(1, 12),
    gamma=st.integers(0, 3),
    topology=st.sampled_from(
        [
            "full",
            "causal",
            "window(2)",
            "window(5)",
            "clusters(3)",
            "segments(3)",
            "window(1) | clusters(2)",
            "window(1) | clusters(2, dynamic=True)",
            "segments(3, causal=True)",
            "causal | star()",
        ]
    ),
    schedule=st.sampled_from(["async", "parallel"]),
    mup=st.booleans(),
    global_labels=st.sampled_from([0, 3]),
    seed=st.integers(0, 10_000),
)
def test_fused_equals_naive_in_values_and_gradients(n, gamma, topology, schedule, mup, global_labels, seed):
    torch.manual_seed(seed)
    crf = graphs.CRF(
        vocab_size=9,
        labels=5,
        channels=2,
        rank=3,
        global_labels=global_labels,
        topology=topology,
        gamma=gamma,
    ).double()
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(3.0)  # peaked attention: near-uniform attention hides bugs
    tokens = torch.randint(0, 9, (3, n))
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, max(1, n // 2) :] = False
    mask[2, 0] = n == 1 or bool(seed % 2)  # a padded position that is not a suffix
    direction = torch.randn(3, crf.topology.num_nodes(n), 5, dtype=torch.float64)
    results = {}
    for kernel in ("naive", "fused"):
        crf.zero_grad()
        post = MeanField(crf, iterations=3, schedule=schedule, mup=mup, kernel=kernel, weights="reference")(
            tokens, mask
        )
        ((post.logits * direction).sum() + post.elbo.sum()).backward()
        results[kernel] = (
            post.logits.detach(),
            post.elbo.detach(),
            post.h.detach(),
            [p.grad.clone() for p in crf.parameters()],
        )
    naive, fused = results["naive"], results["fused"]
    for a, b in zip(naive[:3], fused[:3]):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    for a, b in zip(naive[3], fused[3]):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-8)


def test_fused_equals_naive_in_float32_at_length_200():
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=50, labels=32, channels=4, rank=8, topology="full")
    tokens = torch.randint(0, 50, (2, 200))
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, 150:] = False
    results = {}
    for kernel in ("naive", "fused"):
        crf.zero_grad()
        post = MeanField(crf, iterations=3, kernel=kernel, weights="reference")(tokens, mask)
        post.logits.pow(2).sum().backward()
        results[kernel] = (post.logits.detach(), [p.grad.clone() for p in crf.parameters()])
    torch.testing.assert_close(results["naive"][0], results["fused"][0], atol=2e-5, rtol=1e-5)
    for a, b in zip(results["naive"][1], results["fused"][1]):
        assert ((a - b).abs().max() / a.abs().max()) < 1e-5


@pytest.mark.parametrize("kernel", ["naive", "fused"])
def test_bfloat16_path_is_finite(kernel):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=30, labels=16, channels=2, rank=4, global_labels=4).to(torch.bfloat16)
    tokens = torch.randint(0, 30, (2, 40))
    post = MeanField(crf, iterations=3, kernel=kernel, weights="reference")(tokens)
    post.logits.float().sum().backward()
    assert post.logits.dtype == torch.bfloat16 and torch.isfinite(post.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in crf.parameters())


@settings(max_examples=25)
@given(n=st.integers(2, 9), batch=st.integers(1, 3), iterations=st.integers(1, 5), seed=st.integers(0, 1000))
def test_reference_weights_reproduce_the_reference_algorithm(n, batch, iterations, seed):
    torch.manual_seed(seed)
    d, r, h = 6, 3, 2
    crf = graphs.CRF(vocab_size=20, labels=d, channels=h, rank=r, topology="full", gamma=3).double()
    tokens = torch.randint(0, 20, (batch, n))
    lengths = torch.randint(2, n + 1, (batch,))  # length-1 sentences: see the documented difference
    mask = torch.arange(n)[None] < lengths[:, None]
    with torch.no_grad():
        ours = MeanField(crf, iterations=iterations, weights="reference")(tokens, mask).logits
        # reference parameter layout: [K, d, r, h]
        U, V = crf.ternary_u.permute(0, 2, 3, 1), crf.ternary_v.permute(0, 2, 3, 1)
        theirs = reference_logits(crf.unary[tokens], mask, U, V, iterations, d)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-10, rtol=1e-10)


@pytest.mark.slow  # ~25 s of Pyro SVI; make test-slow (make test < 10 min)
def test_pyro_svi_with_a_mean_field_guide_reaches_the_same_elbo():
    import pyro
    from pyro.infer import SVI, TraceEnum_ELBO
    from pyro.optim import Adam

    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=2, global_labels=2, topology="full")
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(0.7)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 2]])
    crf.requires_grad_(False)
    guide = inference.mean_field_guide(crf, tokens)

    elbo = TraceEnum_ELBO(max_plate_nesting=1)
    svi = SVI(crf.model, guide, Adam({"lr": 0.1}), elbo)
    for _ in range(700):
        svi.step(tokens)
    pyro_elbo = -elbo.loss(crf.model, guide, tokens)
    with torch.no_grad():
        ours = MeanField(crf, iterations=200, schedule="sequential")(tokens).elbo.sum().item()
        log_z = inference.Exact(crf).log_partition(tokens).sum().item()
    assert pyro_elbo <= log_z + 1e-6
    assert abs(pyro_elbo - ours) < 1e-3, (pyro_elbo, ours, log_z)


@pytest.mark.parametrize("topology,n", [("full", 1), ("causal", 3), ("window(1)", 1), ("clusters(1)", 1)])
@pytest.mark.parametrize("kernel", ["naive", "fused"])
def test_rows_without_a_legal_head_give_finite_outputs(topology, n, kernel):
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=2, topology=topology)
    tokens = torch.tensor([[1] * n, [2] * n])
    mask = torch.ones(2, n, dtype=torch.bool)
    post = MeanField(crf, iterations=2, kernel=kernel)(tokens, mask)
    post.logits.sum().backward()
    assert torch.isfinite(post.logits).all() and torch.isfinite(post.elbo).all()
    assert all(torch.isfinite(p.grad).all() for p in crf.parameters())
    rows_without_head = ~crf.arc_mask(mask).any(-1)
    assert (post.h.sum(-1)[rows_without_head[:, None].expand(-1, 2, -1)] == 0).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(iterations=0), "iterations must be an integer >= 1"),
        (dict(schedule="random"), "unknown schedule 'random'"),
        (dict(kernel="cuda"), "unknown kernel 'cuda'"),
        (dict(dropout=1.0), r"dropout must lie in \[0, 1\)"),
        (dict(damping=1.0), "damping for labels"),
        (dict(step_size=(1.0, 0.0)), "step_size for heads"),
        (dict(damping=(0.1, 0.2, 0.3)), r"damping must be a number or a pair \(labels, heads\)"),
        (dict(damping=None), r"damping must be a number or a pair .* got None"),
        (dict(step_size="0.5"), r"step_size must be a number or a pair .* got '0.5'"),
        (dict(step_size=True), "step_size must be a number or a pair"),
        (dict(weights={"attn": 2}), r"unknown message weights \['attn'\]"),
        (dict(weights="other"), "weights must be"),
        (dict(kernel="fused", schedule="sequential"), "kernel='fused' supports no"),
        (dict(kernel="fused", damping=0.5), "kernel='fused' supports no"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    crf = graphs.CRF(vocab_size=5, labels=3)
    with pytest.raises(ValueError, match=match):
        MeanField(crf, **kwargs)


def test_fused_kernel_refuses_head_dropout_in_training():
    crf = graphs.CRF(vocab_size=5, labels=3)
    mf = MeanField(crf, kernel="fused", dropout=0.1).train()
    with pytest.raises(ValueError, match="cannot apply dropout"):
        mf(torch.tensor([[1, 2, 3]]))
    mf.eval()(torch.tensor([[1, 2, 3]]))  # fine in eval mode


def test_mup_scales_are_named_and_applied():
    crf = graphs.CRF(vocab_size=5, labels=8, rank=2, global_labels=4)
    mf = MeanField(crf, mup=True)
    mu = mf.mup_scales
    assert mu.temperature == 4 and mu.attention == 32 and mu.ternary_message == 8 and mu.topic_message == 4
    assert mf.scales()["attention"] == 32 and MeanField(crf).scales()["attention"] == 1
    assert MeanField(crf, weights="reference").scales()["attention"] == 8


@pytest.mark.slow  # ~13 s compile; tests/test_compile.py compiles every kind (slow)
def test_compiled_engine_equals_eager():
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=20, labels=8, channels=2, rank=4, topology="full")
    mf = MeanField(crf, iterations=2, kernel="fused", weights="reference").eval()
    tokens = torch.randint(0, 20, (2, 16))
    compiled = torch.compile(lambda t: mf(t).logits, fullgraph=True)
    torch.testing.assert_close(compiled(tokens), mf(tokens).logits, atol=1e-5, rtol=1e-5)


PARITY_CASES = [  # (beta_z, beta_h, alpha_z, alpha_h): parity with the reference's damping and step sizes
    (0.0, 0.3, 1.0, 1.0),
    (0.0, 0.7, 1.0, 1.0),
    (0.4, 0.0, 1.0, 1.0),
    (0.4, 0.5, 1.0, 1.0),
    (0.0, 0.0, 0.6, 1.0),
    (0.0, 0.0, 1.0, 0.5),
    (0.2, 0.2, 0.8, 0.8),
    (0.5, 0.9, 0.3, 0.7),
    (0.9, 0.1, 1.0, 0.2),
    (0.3, 0.6, 0.5, 0.5),
]


@pytest.mark.parametrize("beta_z,beta_h,alpha_z,alpha_h", PARITY_CASES)
def test_reference_damping_and_step_sizes_reproduce_the_reference_algorithm(beta_z, beta_h, alpha_z, alpha_h):
    """With initial_head_logits="ones" (the reference's first head cache), damping and step
    sizes on labels and heads give the reference iteration's logits to float64 round-off."""
    torch.manual_seed(int(100 * (beta_z + 2 * beta_h + 3 * alpha_z + 4 * alpha_h)))
    d, r, h, n = 6, 3, 2, 7
    crf = graphs.CRF(vocab_size=20, labels=d, channels=h, rank=r, topology="full", gamma=3).double()
    tokens = torch.randint(0, 20, (3, n))
    mask = torch.arange(n)[None] < torch.tensor([[7], [4], [2]])
    engine = MeanField(
        crf,
        iterations=4,
        weights="reference",
        kernel="naive",
        damping=(beta_z, beta_h),
        step_size=(alpha_z, alpha_h),
        initial_head_logits="ones",
    )
    with torch.no_grad():
        ours = engine(tokens, mask).logits
        U, V = crf.ternary_u.permute(0, 2, 3, 1), crf.ternary_v.permute(0, 2, 3, 1)
        theirs = reference_logits(crf.unary[tokens], mask, U, V, 4, d, beta_z, beta_h, alpha_z, alpha_h)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-10, rtol=1e-10)


def test_initial_head_logits_none_differs_from_the_reference_only_with_head_damping():
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=20, labels=6, channels=2, rank=3, topology="full", gamma=3).double()
    tokens = torch.randint(0, 20, (2, 6))

    def run(start, beta_h):
        engine = MeanField(
            crf, iterations=3, weights="reference", kernel="naive", damping=(0.0, beta_h), initial_head_logits=start
        )
        return engine(tokens).logits

    with torch.no_grad():
        assert torch.equal(run("none", 0.0), run("ones", 0.0))
        assert (run("none", 0.5) - run("ones", 0.5)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="initial_head_logits must be one of"):
        MeanField(crf, initial_head_logits="zeros")


@pytest.mark.parametrize("dists", [[2, 4], [3], [2, 3, 4], [], [2, 5, 6]])
@pytest.mark.parametrize("beta_h", [0.0, 0.4])
def test_distance_buckets_reproduce_the_reference_dists(dists, beta_h):
    """gamma as a list of cut points is the reference's `dists`: its distance masks,
    transcribed in tests/reference_pt.py, give the same logits to float64 round-off."""
    torch.manual_seed(len(dists) + int(10 * beta_h))
    d, r, h, n = 5, 3, 2, 8
    crf = graphs.CRF(vocab_size=20, labels=d, channels=h, rank=r, topology="full", gamma=dists).double()
    assert crf.gamma == len(dists) and crf.ternary_u.shape[0] == 2 * (len(dists) + 1)
    tokens = torch.randint(0, 20, (2, n))
    mask = torch.arange(n)[None] < torch.tensor([[8], [5]])
    engine = MeanField(
        crf, iterations=3, weights="reference", kernel="naive", damping=(0.0, beta_h), initial_head_logits="ones"
    )
    with torch.no_grad():
        ours = engine(tokens, mask).logits
        U, V = crf.ternary_u.permute(0, 2, 3, 1), crf.ternary_v.permute(0, 2, 3, 1)
        theirs = reference_logits(crf.unary[tokens], mask, U, V, 3, d, damping_h=beta_h, dists=dists)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dists", [[2, 4], [3], [], [2, 5, 6]])
@pytest.mark.parametrize("topology", ["full", "window(3)", "causal"])
def test_fused_kernel_with_distance_buckets_equals_naive(dists, topology):
    torch.manual_seed(len(dists))
    crf = graphs.CRF(vocab_size=20, labels=5, channels=2, rank=3, topology=topology, gamma=dists).double()
    tokens = torch.randint(0, 20, (2, 11))
    mask = torch.arange(11)[None] < torch.tensor([[11], [6]])
    results = {}
    for kernel in ("naive", "fused"):
        crf.zero_grad()
        post = MeanField(crf, iterations=2, kernel=kernel, weights="reference")(tokens, mask)
        (post.logits.square().sum() + post.elbo.sum()).backward()
        results[kernel] = [post.logits.detach(), post.elbo.detach(), *(p.grad.clone() for p in crf.parameters())]
    for a, b in zip(results["naive"], results["fused"]):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_gamma_as_cut_points_equals_the_integer_clip_and_refuses_bad_cuts():
    torch.manual_seed(0)
    for gamma in (0, 1, 3):
        as_int = graphs.CRF(vocab_size=9, labels=3, channels=1, rank=2, gamma=gamma)
        as_cuts = graphs.CRF(vocab_size=9, labels=3, channels=1, rank=2, gamma=list(range(2, gamma + 2)))
        assert torch.equal(as_int.distance_groups(9), as_cuts.distance_groups(9))
    for bad in ([1, 3], [3, 3], [4, 2], [2.5], [True]):
        with pytest.raises(ValueError, match="gamma as distance buckets"):
            graphs.CRF(vocab_size=9, labels=3, channels=1, rank=2, gamma=bad)
