"""fp16 and bf16 through mean field and the head kernels: finite, close to the
same computation in float32, on batches with rows that have no legal head (padding, the
first token of ``causal``), where a masking constant that overflows the half type (fp16's
largest number is 65504; -1e30 is -inf there) would show as inf or NaN.

The naive kernel masks with -inf and a null head of logit 0; the fused and flex kernels
compute half-precision inputs in float32, so their finite masking constants (-1e30) never
meet a half type.
"""

import copy

import pytest
import torch

import graphs
from inference.mean_field.engine import MeanField
from inference.mean_field.kernels import flex as flex_kernel
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.flex import flex
from tests.builders import head_structure_of

pytestmark = pytest.mark.usefixtures("one_thread")


HALF = [torch.float16, torch.bfloat16]


# relative to the largest entry; measured errors against float32 on these batches are ~4x
# below (fp16 keeps 11 bits, bf16 8)
LOGITS_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 6e-2}


ELBO_TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


GRADIENT_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 5e-2}  # measured: 1.1e-3, 1.4e-2


KERNELS = {"naive": head_kernels.naive, "fused": head_kernels.fused, "flex": flex}


def padded_batch(vocab, n):
    tokens = torch.randint(0, vocab, (3, n))
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n // 2 :] = False  # a padded suffix
    mask[2, 3] = False  # a padded position inside the sentence
    return tokens, mask


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("topology", ["causal", "full | root()"])
@pytest.mark.parametrize("kernel", ["naive", "fused", "flex"])
def test_mean_field_in_half_precision_is_finite_and_close_to_float32(kernel, topology, dtype, monkeypatch):
    # MeanField refuses to train with flex on the CPU; its eager reference is differentiable
    monkeypatch.setattr(flex_kernel, "flex_available", lambda device: True)
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=20, labels=8, channels=2, rank=4, topology=topology, gamma=2, global_labels=3)
    crf = crf.to(dtype)
    wide = copy.deepcopy(crf).float()  # the same (rounded) parameters, computed in float32
    tokens, mask = padded_batch(20, 12)
    results = {}
    for precision, model in ((dtype, crf), (torch.float32, wide)):
        post = MeanField(model, iterations=3, kernel=kernel, weights="reference")(tokens, mask)
        (post.logits.float().square().sum() + post.elbo.float().sum()).backward()
        assert post.logits.dtype == precision
        results[precision] = post.logits.float(), post.elbo.float(), [p.grad.float() for p in model.parameters()]
    (logits, elbo, grads), (logits32, elbo32, grads32) = results[dtype], results[torch.float32]
    assert torch.isfinite(logits).all() and torch.isfinite(elbo).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert (logits - logits32).abs().max() <= LOGITS_TOLERANCE[dtype] * logits32.abs().max()
    assert (elbo - elbo32).abs().max() <= ELBO_TOLERANCE[dtype] * elbo32.abs().max()
    for g, g32 in zip(grads, grads32, strict=True):
        assert (g - g32).abs().max() <= GRADIENT_TOLERANCE[dtype] * g32.abs().max()


def structure_of(topology, gamma, mask):
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=4, topology=topology, gamma=gamma)
    return head_structure_of(crf, mask), crf.num_groups


def half_projections(structure, groups, dtype, size):
    N = structure.nodes.shape[1]
    return [(size * torch.randn(3, N, groups, 2, 4)).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("topology", ["causal", "window(2) | root()"])
def test_head_kernels_in_half_precision_match_float32(kernel, topology, dtype):
    """Moderate scores: the half result is the float32 result of the same inputs, rounded."""
    torch.manual_seed(1)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2] = False  # a whole padded sentence: no token has a head
    structure, groups = structure_of(topology, 2, mask)
    projections = [p.requires_grad_() for p in half_projections(structure, groups, dtype, 1.0)]
    result = KERNELS[kernel](*projections, 1.0, structure)
    wide = KERNELS[kernel](*(p.detach().float() for p in projections), 1.0, structure)
    for ours, theirs in ((result.forward, wide.forward), (result.reverse, wide.reverse), (result.lse, wide.lse)):
        assert ours.dtype == dtype and torch.isfinite(ours).all()
        assert (ours.float() - theirs).abs().max() <= LOGITS_TOLERANCE[dtype] * max(1.0, theirs.abs().max())
    no_head = ~structure.has_head
    assert (result.lse.transpose(1, 2)[no_head] == 0).all() and (result.forward[no_head] == 0).all()
    (result.forward.float().sum() + result.reverse.float().sum() + result.lse.float().sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in projections)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_head_kernels_stay_finite_at_large_half_precision_scores(kernel, dtype):
    """Scores near fp16's range (|score| up to ~2e4 < 65504) next to rows with no head:
    every kernel finite in values and gradients."""
    torch.manual_seed(2)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 0] = False
    structure, groups = structure_of("causal | star()", 1, mask)
    projections = [p.requires_grad_() for p in half_projections(structure, groups, dtype, 30.0)]
    largest = torch.einsum("bikcr,bjkcr->bkcij", projections[0].float(), projections[1].float()).abs().max()
    assert 1e3 < largest < 6e4
    result = KERNELS[kernel](*projections, 1.0, structure)
    assert all(torch.isfinite(t).all() for t in (result.forward, result.reverse, result.lse))
    (result.forward.float().sum() + result.reverse.float().sum() + result.lse.float().sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in projections)
