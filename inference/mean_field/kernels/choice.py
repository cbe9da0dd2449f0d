"""Which head kernel a ``MeanField`` runs, in which precision, and the call itself.

``MeanField.resolved_kernel``, ``fused_compute_dtype`` and ``heads`` delegate here with the
engine's options (``MeanFieldOptions``), its CRF, its score-bound cache (``ScoreBound``)
and whether it trains; the engine keeps the maths of mean field, this module the choice
between kernels that compute the same messages (``inference.mean_field.kernels.head_kernels``,
``inference.mean_field.kernels.flex``).
"""

from __future__ import annotations

import torch

from inference.mean_field.kernels import flex as flex_kernel
from inference.mean_field.kernels import head_kernels

__all__ = ["resolved_kernel", "ScoreBound", "fused_compute_dtype", "heads", "log_normaliser"]

# perf.md: at n <= ~128 the materialised kernel is as fast as the fused one.
AUTO_FUSED_MIN_NODES = 129
# The shared ternary form: one projection for every group makes the materialised kernel plain
# GEMMs with no per-group masks, faster than the fused kernel up to n = 512 (measured by
# benchmarks/shared_form.py; figures in docs/benchmarks.md), with [B, C, n, n] marginals of
# 64 MiB at n = 512 (B = 8, C = 8). Past 512 nodes: the memory-linear fused kernel.
AUTO_FUSED_MIN_NODES_SHARED = 513
# the fused kernel in float32 errs by about |score| 2**-23 relative (head_kernels.fused);
# measured on random CRFs (benchmarks/reliability): <= 1e-4 after 3 iterations while the
# score bound stays below 512, up to O(1) at 1e8. Past it the fused kernel computes in float64.
FUSED_FLOAT32_MAX_SCORE = 512.0


def resolved_kernel(options, crf, num_nodes: int, device: torch.device, training: bool) -> str:
    """The kernel an engine with ``options`` on ``crf`` runs on ``num_nodes`` nodes on
    ``device``, in training mode or not (``MeanFieldOptions``)."""
    if options.kernel != "auto":
        if options.kernel in ("fused", "flex") and options.dropout and training:
            raise ValueError(
                f"kernel={options.kernel!r} cannot apply dropout to head marginals; use kernel='naive' "
                "or dropout=0 (or eval mode)"
            )
        return options.kernel
    shared = getattr(crf, "ternary_form", None) == "shared"
    fused_from = AUTO_FUSED_MIN_NODES_SHARED if shared else AUTO_FUSED_MIN_NODES
    # a topology whose rows have token arcs of their own length (star(wrap=True), a function of n)
    # is read from a table per row by every kernel: the same thresholds as any other
    if (options.dropout and training) or options.heads_need_naive:
        return "naive"
    if flex_kernel.flex_available(device):  # CUDA: the compiled flex_attention kernel
        return "flex"
    if not head_kernels.fused_available(device) or num_nodes < fused_from:
        return "naive"
    return "fused"


class ScoreBound:
    """The head scores' bound of one CRF's parameters, cached per parameter state; owned by
    the engine that reads it (``fused_compute_dtype``).

    The bound is recomputed only when a parameter changed (its version counter, a host-side
    number), e.g. once per optimiser step, never per forward of a fixed model; under
    torch.compile / export the last value read eagerly is used. Reading it is a host sync on
    the CPU; on a GPU it is copied back without one, so a training step that moved the bound
    is seen from the next parameter change on (one step late)."""

    def __init__(self):
        self.cached = None  # (parameter state, (scores, largest |bias|))
        self.pending = None  # (parameter state, pinned host copy, CUDA event)

    def read(self, crf):
        """``(scores, largest |bias|)`` of ``crf``'s parameters as last known, or 0.0 where
        nothing can be read (meta tensors; a traced graph with no eager read yet)."""
        if crf.unary.is_meta:  # shapes only (nothing to read): the input's type
            return 0.0
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return self.cached[1] if self.cached is not None else 0.0  # a traced graph reads no version counter
        self._adopt_arrived()
        try:
            state = tuple((id(p), p._version) for p in crf.parameters())
        except RuntimeError:  # inference-mode tensors keep no version counter: always recompute
            state = None
        if state is None or self.cached is None or self.cached[0] != state:
            return self._refresh(crf, state)
        return self.cached[1]

    def _adopt_arrived(self) -> None:
        """Adopt a bound copied from the GPU once its event has passed (it is the bound of
        the parameters as they were when it was sent: newer than any cached one)."""
        if self.pending is None or not self.pending[2].query():
            return
        pending, self.pending = self.pending, None
        state = self.cached[0] if self.cached is not None else pending[0]
        self.cached = (state, tuple(float(x) for x in pending[1]))

    def _refresh(self, crf, state) -> tuple[float, float]:
        """The bound for parameter ``state``. On the CPU (or without an earlier value) read at
        once; on a GPU copied into pinned memory behind an event, read at a later call once
        the event has passed, the previous value serving until then."""
        values = _device_bound(crf)
        if values.device.type != "cuda" or self.cached is None or state is None:
            bound = tuple(float(x) for x in values.cpu())
            self.cached = (state, bound)
            return bound
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (state, host, event)
        self.cached = (state, self.cached[1])  # this state's value is on its way
        return self.cached[1]


def fused_compute_dtype(crf, score_bound: ScoreBound, scale: float) -> torch.dtype | None:
    """float64 when ``crf``'s parameters allow head scores (times ``scale``) beyond what
    the fused kernel computes accurately in float32, else None (the input's type).
    ``score_bound``: the cache of the bound (``ScoreBound``), owned by the caller."""
    bound = score_bound.read(crf)
    scores, bias = bound if isinstance(bound, tuple) else (bound, 0.0)
    return torch.float64 if abs(scale) * scores + bias > FUSED_FLOAT32_MAX_SCORE else None


def _device_bound(crf) -> torch.Tensor:
    """``[2]``: the head scores' bound and the bias's largest magnitude, on the parameters' device."""
    with torch.no_grad():
        u, v, bias = crf.projection_tables()
        scores = head_kernels.score_bound(u, v)
        largest_bias = scores.new_zeros(()) if bias is None else bias.abs().max().to(scores.dtype)
        return torch.stack([scores, largest_bias])


def heads(
    options,
    crf,
    score_bound: ScoreBound,
    query,
    key,
    value,
    value_rev,
    structure,
    kernel,
    *,
    training: bool,
    previous=None,
    groups=None,
    back=None,
):
    """The head messages (``head_kernels.HeadMessages``) through ``kernel`` for an engine with
    ``options`` on ``crf``; ``previous``: the last iteration's (the naive kernel's damping and
    step size read it); ``groups``: the groups the projections hold (the fused kernel only:
    ``MeanField.gemm_tables``); ``back``: the back-projection tables, which the fused kernel
    applies as it writes the messages (``HeadMessages.label_message``; the others leave it
    to ``MeanField.label_logits``)."""
    scale = options.scales()["attention"]
    bias = crf.projection_tables()[2]
    if groups is not None and kernel != "fused":
        raise ValueError(f"only the fused kernel reads projections onto some groups, not {kernel!r}")
    if kernel in ("fused", "flex"):
        compute_dtype = fused_compute_dtype(crf, score_bound, scale)
        kernel = _flex_or_fused(kernel, query, compute_dtype)
        if kernel == "fused":
            fused_options = dict(compute_dtype=compute_dtype, bias=bias, groups=groups, back=back)
            return head_kernels.fused(query, key, value, value_rev, scale, structure, **fused_options)
        return flex_kernel.flex(query, key, value, value_rev, scale, structure, compute_dtype=compute_dtype, bias=bias)
    first = query.new_ones(()) if options.initial_head_logits == "ones" else None  # the reference's cache
    return head_kernels.naive(
        query,
        key,
        value,
        value_rev,
        scale,
        structure,
        damping=options.damping[1],
        previous_logits=first if previous is None else previous.logits,
        step_size=options.step_size[1],
        previous_probs=None if previous is None else previous.probs,
        dropout=options.dropout,
        training=training,
        bias=bias,
    )


def log_normaliser(crf, score_bound: ScoreBound, query, key, structure, kernel) -> torch.Tensor:
    """``[B, C, N]`` row log-normalisers of the head logits at scale 1 (what the ELBO reads),
    through ``kernel``, 0 on rows with no legal head."""
    bias = crf.projection_tables()[2]
    wide = fused_compute_dtype(crf, score_bound, 1.0) if kernel in ("fused", "flex") else None
    kernel = _flex_or_fused(kernel, query, wide)
    if kernel == "flex":
        options = dict(messages=False, compute_dtype=wide, bias=bias)
        return flex_kernel.flex(query, key, key, query, 1.0, structure, **options).lse
    return head_kernels.log_normaliser(query, key, 1.0, structure, kernel, wide, bias)


def _flex_or_fused(kernel: str, query: torch.Tensor, compute_dtype: torch.dtype | None) -> str:
    """The flex kernel where it is sound, else the fused one or a refusal. float64 on CUDA runs
    the fused kernel (tested in float64; flex's Triton kernel is not). On the CPU flex runs its
    eager reference, which materialises the scores and whose compiled form has no backward:
    training with it there is refused, naming the kernel that trains on the CPU."""
    if kernel != "flex":
        return kernel
    if query.device.type == "cuda" and torch.float64 in (compute_dtype, query.dtype):
        return "fused"
    if not flex_kernel.flex_available(query.device) and torch.is_grad_enabled() and query.requires_grad:
        raise ValueError(
            f"kernel='flex' cannot train on {query.device.type!r}: flex_attention has no backward there "
            "(its eager reference materialises every score); use kernel='fused' to train, or run kernel='flex' "
            "without gradients (torch.no_grad() or inference)"
        )
    return kernel
