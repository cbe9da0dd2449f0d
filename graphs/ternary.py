"""The forms of the CRF's ternary tensor ``T[k] : [C, d, d]`` (``CRF(ternary_form=...)``).

``T[k, c, a, b]`` is the log-potential of head ``H_i^c = j`` in distance group
``k = k(i, j)`` with dependent label ``Z_i = a`` and head label ``Z_j = b``. Engines read
the per-group, per-channel factors ``ternary_u`` / ``ternary_v`` ``[K, C, d, r_eff]`` with
``T[k, c] = ternary_u[k, c] ternary_v[k, c]^T``, which every form computes
(``factors``):

    "low_rank"  T[k, c] = U[k, c] V[k, c]^T                 U, V: [K, C, d, r]
    "cp"        T[k, c, a, b] = sum_p W[k, c, p] A[k, a, p] B[k, b, p]   (CP, rank r)
                -> ternary_u[k, c] = A[k] diag(W[k, c]), ternary_v[k, c] = B[k]
    "tucker"    T[k, c] = sum_m A_m[k] G_m[k, c] B_m[k]^T   (block-term: ``ternary_blocks``
                Tucker blocks of multilinear rank (r, r), a core per channel)
                -> ternary_u[k, c] = [A_m[k] G_m[k, c]]_m, ternary_v[k, c] = [B_m[k]]_m
    "shared"    T[k, c, a, b] = U[c, a] . V[c, b] + bias[k, c]
                one U, V per channel for every distance group (``shared_u``, ``shared_v``
                ``[C, d, r]``) and a learned bias per group and channel (``shared_bias``
                ``[K, C]``, initially 0): distance enters as a prior on the head's group, as
                relative-position biases do in attention. Exactly a rank r + 1 per-group form:
                -> ternary_u[k, c] = [U[c], bias[k, c] 1], ternary_v[k, c] = [V[c], 1]
                (the last column multiplies to bias[k, c] for every pair of labels).

The shared form's own parameters have their own names (``shared_*``), so ``crf.ternary_u``
means the per-group factors ``[K, C, d, r_eff]`` for every form. Its projections cost what
one attention layer's do: ``MeanField`` projects once per channel (``projection_tables``:
tables with a group axis of size 1, shared by every group) and adds the bias to the head
logits, instead of projecting once per group.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "TERNARY_FORMS",
    "PARAMETERS",
    "create",
    "factors",
    "projection_tables",
    "potential_bound",
    "parameter_count",
    "summing_dtype",
]

TERNARY_FORMS = ("low_rank", "cp", "tucker", "shared")
# each form's own parameters on the CRF
PARAMETERS = {
    "low_rank": ("ternary_u", "ternary_v"),
    "cp": ("cp_dependent", "cp_head", "cp_channel"),
    "tucker": ("tucker_dependent", "tucker_head", "tucker_core"),
    "shared": ("shared_u", "shared_v", "shared_bias"),
}


def check_form(form) -> None:
    if form not in TERNARY_FORMS:
        raise ValueError(f"ternary_form must be one of {list(TERNARY_FORMS)}, got {form!r}")


def create(crf: nn.Module, form: str, groups: int, channels: int, labels: int, rank: int, blocks: int) -> None:
    """Register ``form``'s parameters on ``crf``. Every form starts with factor entries of
    variance 1/r (the effective rank of "tucker" is blocks x r; its cores are scaled so
    that T has the same variance); the shared form's bias starts at 0 (no distance prior)."""
    check_form(form)
    std, K = rank**-0.5, groups
    if form == "low_rank":
        crf.ternary_u = nn.Parameter(torch.randn(K, channels, labels, rank) * std)
        crf.ternary_v = nn.Parameter(torch.randn(K, channels, labels, rank) * std)
    elif form == "cp":
        crf.cp_dependent = nn.Parameter(torch.randn(K, labels, rank) * std)
        crf.cp_head = nn.Parameter(torch.randn(K, labels, rank) * std)
        crf.cp_channel = nn.Parameter(torch.randn(K, channels, rank))
    elif form == "tucker":
        crf.tucker_dependent = nn.Parameter(torch.randn(blocks, K, labels, rank) * std)
        crf.tucker_head = nn.Parameter(torch.randn(blocks, K, labels, rank) * std)
        crf.tucker_core = nn.Parameter(torch.randn(blocks, K, channels, rank, rank) * (blocks * rank) ** -0.5)
    else:
        crf.shared_u = nn.Parameter(torch.randn(channels, labels, rank) * std)
        crf.shared_v = nn.Parameter(torch.randn(channels, labels, rank) * std)
        crf.shared_bias = nn.Parameter(torch.zeros(K, channels))


def factors(crf) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ternary_u, ternary_v)``, each ``[K, C, d, r_eff]``, for any form."""
    form, C = crf.ternary_form, crf.channels
    if form == "low_rank":
        return crf.ternary_u, crf.ternary_v
    if form == "cp":
        u = crf.cp_dependent[:, None] * crf.cp_channel[:, :, None, :]  # [K, C, d, r]
        return u, crf.cp_head[:, None].expand(-1, C, -1, -1)
    if form == "tucker":
        u = torch.einsum("mkap,mkcpq->kcamq", crf.tucker_dependent, crf.tucker_core)  # [K, C, d, M, r]
        v = crf.tucker_head.permute(1, 2, 0, 3)[:, None].expand(-1, C, -1, -1, -1)  # [K, C, d, M, r]
        return u.flatten(-2), v.flatten(-2)
    bias = crf.shared_bias  # [K, C]
    K, d = bias.shape[0], crf.labels
    u = torch.cat([crf.shared_u.expand(K, -1, -1, -1), bias[:, :, None, None].expand(-1, -1, d, 1)], -1)
    v = torch.cat([crf.shared_v, torch.ones_like(crf.shared_v[..., :1])], -1).expand(K, -1, -1, -1)
    return u, v


def projection_tables(crf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(u, v, bias)`` for the engines' projections: ``u``, ``v`` ``[K, C, d, r]`` per group,
    or ``[1, C, d, r]`` shared by every group (the shared form), and the head-logit bias
    ``[K, C]`` of each group and channel (None: no bias). ``T[k, c] = u[k or 0, c] v[k or 0,
    c]^T + bias[k, c]`` for every form."""
    if crf.ternary_form == "shared":
        return crf.shared_u[None], crf.shared_v[None], crf.shared_bias
    u, v = factors(crf)
    return u, v, None


def potential_bound(crf) -> torch.Tensor:
    """``[K or 1, C]``: ``sum_r max_a |u[k, c, a, r]| max_b |v[k, c, b, r]| (+ |bias[k, c]|)``
    of the projection tables, in at least float32. It bounds every ternary potential
    ``|T[k, c, a, b]|``, every partial sum the products ``u v^T`` build, and every head score
    ``q U V^T q'`` of label distributions (MeanField's), so where it is finite in the CRF's
    dtype none of them overflows. O(K C d r): a pass over the tables, no ``[d, d]`` table."""
    with torch.no_grad():
        u, v, bias = projection_tables(crf)
        dtype = torch.promote_types(u.dtype, torch.float32)  # half tables: no overflow of the bound itself
        bound = (u.abs().amax(-2).to(dtype) * v.abs().amax(-2).to(dtype)).sum(-1)
        return bound if bias is None else bound + bias.abs().to(dtype)


def parameter_count(crf) -> int:
    """The ternary tensor's own parameters (those of its form)."""
    own = PARAMETERS[crf.ternary_form]
    return sum(p.numel() for name, p in crf.named_parameters() if name in own)


def summing_dtype(dtype) -> torch.dtype | None:
    """``CRF.ternary_tensor``'s ``dtype``: None (the CRF's) or a floating torch dtype; an
    integer dtype truncated every potential, and text failed inside ``Tensor.to``."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype (e.g. torch.float64), got {dtype!r}")
    return dtype
