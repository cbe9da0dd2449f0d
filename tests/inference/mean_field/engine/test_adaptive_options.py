"""The engine's adaptive options, by their invariants and oracles: adaptive attention span,
the Macaron schedule, the product-key memory, and the CP / Tucker forms of the ternary tensor."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inference
from tests.builders import engine_options_batch as batch
from tests.builders import engine_options_crf as crf

torch.set_num_threads(1)


# ---- adaptive span --------------------------------------------------------------------


def test_span_mask_formula_and_full_span_is_no_mask():
    engine = inference.MeanField(crf(topology="full | root()"), iterations=2, span=True, span_max=10, span_ramp=4)
    with torch.no_grad():
        engine.span.copy_(torch.tensor([0.15, 2.0]))  # fractions of span_max; the second is clamped to 1
    prior = engine.span_prior(6, 7)
    for c, z in enumerate([1.5, 10.0]):
        for i in range(6):
            for j in range(6):
                m = min(max((4 + z - abs(i - j)) / 4, 0.0), 1.0)
                assert prior[c, i, j].item() == pytest.approx(math.log(max(m, 1e-6)), abs=1e-5)
    assert (prior[:, 6] == 0).all() and (prior[:, :, 6] == 0).all()  # arcs to ROOT are not distance-masked
    # spans covering the sentence: the same posterior as without a span
    tokens, mask = batch()
    plain = inference.MeanField(crf(), iterations=3)
    spanned = inference.MeanField(crf(), iterations=3, span=True, span_max=16)
    assert torch.allclose(plain(tokens, mask).logits, spanned(tokens, mask).logits, atol=1e-6)
    with pytest.raises(ValueError, match="no adaptive span"):
        inference.MeanField(crf(), span=True, kernel="fused")


def test_short_spans_keep_the_elbo_a_bound_under_the_span_prior():
    """The span is a log prior on the heads; the engine's ELBO stays finite and the
    posterior moves mass to near heads."""
    engine = inference.MeanField(crf(topology="full"), iterations=3, span=True, span_max=8, span_ramp=1)
    with torch.no_grad():
        engine.span.fill_(1 / 8)  # z = 1
    tokens, mask = batch()
    posterior = engine(tokens, mask)
    heads = posterior.h  # [B, C, N, N]
    distance = (torch.arange(7)[None] - torch.arange(7)[:, None]).abs()
    assert heads[..., distance > 2].max() < 1e-5  # m(x) = 0 beyond z + R
    assert torch.isfinite(posterior.elbo).all()


# ---- Macaron ---------------------------------------------------------------------------


def test_macaron_equals_async_when_the_global_factor_is_zero():
    tokens, mask = batch()
    field = crf()
    with torch.no_grad():
        field.binary.zero_()
    macaron = inference.MeanField(field, iterations=4, schedule="macaron")(tokens, mask)
    ordinary = inference.MeanField(field, iterations=4, schedule="async")(tokens, mask)
    assert torch.allclose(macaron.logits, ordinary.logits, atol=1e-6)
    with pytest.raises(ValueError, match="needs global_labels"):
        inference.MeanField(crf(global_labels=0), schedule="macaron")


def test_macaron_is_a_mean_field_posterior_below_the_exact_log_partition():
    """Oracle: whatever the order of updates, the result is a member of the mean-field
    family, so its ELBO is at most log Z; and it differs from async with a global factor."""
    field = crf(labels=3, global_labels=2, rank=2).double()
    with torch.no_grad():
        field.binary.mul_(3.0)
    tokens, mask = batch(size=2, length=4)
    log_z = inference.Exact(field).log_partition(tokens, mask)
    macaron = inference.MeanField(field, iterations=6, schedule="macaron")(tokens, mask)
    ordinary = inference.MeanField(field, iterations=6, schedule="async")(tokens, mask)
    assert (macaron.elbo <= log_z + 1e-9).all() and (log_z - macaron.elbo < 5).all()
    assert not torch.allclose(macaron.logits, ordinary.logits)


# ---- product-key memory -------------------------------------------------------------------


def test_product_key_memory_with_all_keys_is_the_dense_posterior():
    field = crf(labels=6, global_labels=16, global_memory="product_key")
    engine = inference.MeanField(field, iterations=2, memory_topk=16)
    query = torch.randn(3, 5, 6)
    probs, index = engine.memory_posterior(query, 16)
    dense, dense_index = engine.memory_posterior(query, None)
    scattered = torch.zeros_like(dense).scatter(-1, index, probs)
    assert torch.allclose(scattered, dense, atol=1e-6)
    # the dense posterior by hand: scores of all (m1, m2) pairs
    first, second = query[..., :3] @ field.memory_keys_first.T, query[..., 3:] @ field.memory_keys_second.T
    by_hand = (first[..., :, None] + second[..., None, :]).flatten(-2).softmax(-1)
    assert torch.allclose(dense, by_hand, atol=1e-6)
    tokens, mask = batch()
    full = engine(tokens, mask).logits
    engine.memory_topk = 1_000  # more than every key: the same computation
    assert torch.allclose(engine(tokens, mask).logits, full, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5))
def test_product_key_top_k_is_the_exact_top_k_of_the_dense_scores(seed, k):
    torch.manual_seed(seed)
    field = crf(labels=6, global_labels=25, global_memory="product_key", seed=seed)
    engine = inference.MeanField(field)
    query = torch.randn(4, 6)
    probs, index = engine.memory_posterior(query, k)
    first, second = field.memory_scores(query)
    scores = (first[..., :, None] + second[..., None, :]).flatten(-2)
    best = scores.topk(k, dim=-1)
    assert torch.allclose(scores.gather(-1, index).sort(-1).values, best.values.sort(-1).values, atol=1e-6)
    assert torch.allclose(probs, scores.gather(-1, index).softmax(-1), atol=1e-6)


def test_product_key_memory_is_not_a_crf_factor():
    field = crf(global_labels=16, global_memory="product_key")
    tokens, mask = batch()
    with pytest.raises(ValueError, match="not a CRF factor"):
        field.model(tokens, mask)
    with pytest.raises(ValueError, match="not a CRF factor"):
        _ = inference.MeanField(field)(tokens, mask).elbo
    with pytest.raises(ValueError, match="global_labels = s\\^2"):
        crf(global_labels=12, global_memory="product_key")


# ---- tensor forms of the ternary potential ---------------------------------------------


def test_cp_and_tucker_reconstruct_the_dense_tensor_and_count_parameters():
    K, C, d, r = 8, 2, 6, 3
    cp = crf(ternary_form="cp")
    dense = torch.einsum("kcp,kap,kbp->kcab", cp.cp_channel, cp.cp_dependent, cp.cp_head)
    assert torch.allclose(cp.ternary_tensor(), dense, atol=1e-6)
    assert cp.ternary_parameter_count() == K * (2 * d * r + C * r)
    tucker = crf(ternary_form="tucker", ternary_blocks=2)
    dense = sum(
        torch.einsum("kap,kcpq,kbq->kcab", tucker.tucker_dependent[m], tucker.tucker_core[m], tucker.tucker_head[m])
        for m in range(2)
    )
    assert torch.allclose(tucker.ternary_tensor(), dense, atol=1e-6)
    assert tucker.ternary_parameter_count() == 2 * K * (2 * d * r + C * r * r)
    assert crf().ternary_parameter_count() == 2 * K * C * d * r
    with pytest.raises(ValueError, match="ternary_form must be one of"):
        crf(ternary_form="dense")


@pytest.mark.parametrize("form", ["cp", "tucker"])
def test_mean_field_on_tensor_forms_is_bounded_by_the_exact_log_partition(form):
    """Oracle: the engine reads the factors, Exact the reconstructed tensor; the ELBO of
    every iteration lies below log Z."""
    field = crf(ternary_form=form, ternary_blocks=2, labels=3, global_labels=2, rank=2).double()
    tokens, mask = batch(size=2, length=4)
    mask[1, 2:] = False
    log_z = inference.Exact(field).log_partition(tokens, mask)
    engine = inference.MeanField(field, iterations=12, schedule="sequential")
    elbo_steps = engine(tokens, mask).trace["elbo_steps"]
    assert (elbo_steps <= log_z + 1e-9).all()
    assert (elbo_steps[1:] >= elbo_steps[:-1] - 1e-9).all()  # coordinate ascent never decreases it
