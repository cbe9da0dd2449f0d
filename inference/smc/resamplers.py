"""Resamplers of the batched particle filter (``inference.smc.filter``): ancestor indices ``[B, N]``
for the weights ``[B, N]`` of B independent filters, with no host read.

Hard resamplers (offspring counts have expectation N w_i): multinomial, stratified,
systematic, residual. Relaxations for training through resampling: ``"gumbel-softmax"``
(each new particle is a softmax((log w + Gumbel) / tau) mixture of the old ones) and
``"straight-through"`` (the hard Gumbel-max choice forward, the soft mixture's gradient
backward).
"""

from __future__ import annotations

import torch

from graphs.device_checks import refuse_non_finite, refuse_unless

__all__ = [
    "RESAMPLERS",
    "RELAXATIONS",
    "resample_indices",
    "unchecked_resample_indices",
    "systematic_ancestors",
    "SystematicResampler",
    "relaxed_mixing",
]

RESAMPLERS = ("multinomial", "stratified", "systematic", "residual")
RELAXATIONS = (None, "gumbel-softmax", "straight-through")


class SystematicResampler:
    """Systematic resampling of unnormalised weights ``[B, N]`` on buffers kept across calls
    (one filter run: the same B, N, dtype and device): a filter step allocates nothing for
    it, and its working set stays in cache.

    Position i + 1 - v (v ~ U[0, 1) per filter, scaled to N) falls past particle j's
    cumulative weight C_j exactly for i >= first_j = floor(N C_j / total + v), so ancestor_i =
    #{j : first_j <= i}: a histogram of first (one scatter) and a cumulative sum. O(N)
    per filter, where a binary search per position (``searchsorted``) is O(N log N) and,
    on CPUs, far slower at N = 1,000 (docs/benchmarks.md)."""

    def __init__(
        self,
        batch: int,
        num_particles: int,
        device=None,
        dtype: torch.dtype | None = None,
        steps: torch.Tensor | None = None,
        row_sums: bool = False,
    ):
        """``steps``: a ``[B, N]`` buffer for the scaled weights, e.g. the caller's weights buffer
        when it may be overwritten (a smaller working set); None: one of its own.
        ``row_sums``: every ``total`` passed is the floating-point sum of its row of weights
        and the largest weight of a row is 1 (the filter's weights): totals in [1, N]."""
        B, N = batch, num_particles
        # the steps N w_j / total in units of 2**-shift, in float32 or float64 (half precision
        # overflows at 2**16); their cumulative sum in int64 fixed point: exact, and on CPUs
        # faster than a floating-point one (which accumulates float32 in float64;
        # docs/benchmarks.md). The shift leaves room for N + 1 positions below 2**63
        wide = (torch.float32, torch.float64)
        if steps is None or steps.dtype not in wide:
            steps_dtype = dtype if dtype in wide else torch.float32
            steps = torch.empty(B, N, device=device, dtype=steps_dtype)
        self.steps = steps
        self.shift = 62 - (N + 1).bit_length()
        self.fixed = torch.empty(B, N, device=device, dtype=torch.long)
        # with row sums for totals, the cumulative weights round past N by at most ~N (N + 4) eps
        # positions (the sum, the scale and the products each err by eps relative): less than
        # one when that is < 1, which a histogram one wider than N + 1 takes in (no clamp, one
        # pass fewer); otherwise (or any other totals) positions are clamped at N
        eps = max(torch.finfo(self.steps.dtype).eps, torch.finfo(dtype or torch.get_default_dtype()).eps)
        self.row_sums = row_sums
        self.clamp = not row_sums or N * (N + 4) * eps >= 1
        self.counts = torch.empty(B, N + 1 + (not self.clamp), device=device, dtype=torch.int32)
        # views a call reads and writes, taken once (a view is an operator call, on every call)
        self.first_fixed, self.total_fixed = self.fixed.narrow(1, 0, 1), self.fixed.narrow(1, N - 1, 1)
        self.positions = self.counts.narrow(1, 0, N)
        # materialised: a scatter over an expanded source (stride 0) takes a slower path
        # on CPUs (and an expanded one, or positions written into ``out``, make torch.compile's
        # graph of a filter disagree with eager)
        self.ones = torch.ones(B, N, device=device, dtype=torch.int32)

    def __call__(self, weights, total=None, resampled=None, generator=None, out=None, kept=None) -> torch.Tensor:
        """Ancestors ``[B, N]`` (int64, written into ``out`` if given) for weights ``[B, N]``
        with row sums ``total`` ``[B]`` or ``[B, 1]`` (None: normalised rows). Filters where
        ``resampled`` (``[B]`` or ``[B, 1]``, bool or 0/1 numbers) is False (0) get the identity.
        ``kept``: ``1 - resampled`` as numbers ``[B, 1]`` in the steps' dtype, when the caller
        has it (the filter's next weights take it): one operator fewer."""
        B, N = weights.shape
        unit = float(2**self.shift)
        # the positions are i + 1 - v, v ~ U[0, 1): first_j = floor(N C_j / total + v), v drawn
        # in the units of the fixed point (v = offset / 2**shift)
        offset = torch.randint(2**self.shift, (B, 1), device=weights.device, generator=generator)
        dtype = self.steps.dtype
        # a filter that does not resample gets steps 1 (cumulative j + 1, exact): first_j =
        # floor(j + 1 + v) = j + 1, the identity. Arithmetic on the finite weights, not a
        # torch.where over [B, N]: fewer and cheaper passes on CPUs (and not addcmul either:
        # with [B, 1] operands it is slower than the two passes)
        chosen = None if resampled is None else _column(resampled).to(dtype)
        if self.row_sums and total is not None:
            # totals in [1, N]: the scale N 2**shift / total is finite, one pass
            total = _column(_value(total))
            scale = torch.reciprocal(total) if chosen is None else torch.div(chosen, total)
            steps = torch.mul(weights, scale.mul_(N * unit), out=self.steps)
        else:
            # any weights: normalised first (N 2**shift / total overflows float32 for totals
            # below ~1e-20), in the steps' precision (float16 products overflow at 2**16); rows
            # given as normalised are divided by their sums too (int64 overflows at sums ~2)
            total = weights.sum(-1, keepdim=True, dtype=dtype) if total is None else _column(_value(total))
            steps = torch.div(weights.to(dtype), total.to(dtype), out=self.steps)
            steps.mul_(N * unit if chosen is None else chosen * (N * unit))
        if kept is not None:  # unit * kept is exactly 0 or unit, as unit - unit * chosen is
            steps.add_(kept, alpha=unit)
        elif chosen is not None:
            steps.add_(torch.rsub(chosen, unit, alpha=unit))
        fixed = self.fixed.copy_(steps)  # non-negative: truncation is the floor
        # the offset joins the first step: one cumulative sum gives N C_j / total + v
        self.first_fixed.add_(offset)
        cumulative = fixed.cumsum_(-1)
        # the last live particle: the first to reach the total (a zero weight adds exactly 0
        # in fixed point), found by a binary search of each row, O(log N)
        last_live = torch.searchsorted(cumulative, self.total_fixed.contiguous(), out_int32=True)
        first = cumulative.bitwise_right_shift_(self.shift)
        if self.clamp:  # and at 0: a NaN row (weights summing to 0) is cast to negative integers
            first.clamp_(0, N)
        self.counts.zero_().scatter_add_(1, first, self.ones)
        positions = self.positions.cumsum_(-1)
        # a position that rounding leaves past the last live particle's end (its cumulative
        # weight fell short of N) goes to it, never to a particle of weight 0 after it (in place
        # by clamp_max_, which Dynamo traces: minimum's out= into this non-contiguous view breaks
        # a compiled filter's graph at every step). The minimum also stands for setting the last
        # particle's first position to N (the total is the last cumulative weight: every
        # position falls before it): where the last particle's first position is <= i, so is
        # every particle's (they do not decrease), and position i counts N or N - 1 particles,
        # both at least last_live (<= N - 1)
        positions = positions.clamp_max_(last_live)
        if out is not None and not torch.compiler.is_compiling():
            return out.copy_(positions)
        # under compile the caller gets a fresh tensor and ``out`` a copy of it: inductor's CPU
        # code (torch 2.13) misreads the result of a copy into a view of a graph input later in
        # the same graph (the filter's gather took other ancestors than it recorded)
        ancestors = positions.long()
        if out is not None:
            out.copy_(ancestors)
        return ancestors


def _value(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor without its autograd history; itself when it has none (detach is an
    operator call)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _column(per_filter: torch.Tensor) -> torch.Tensor:
    """``[B]`` or ``[B, 1]`` as ``[B, 1]`` (no dispatch when it already is one)."""
    return per_filter if per_filter.dim() == 2 else per_filter.unsqueeze(1)


def systematic_ancestors(
    weights: torch.Tensor,
    total: torch.Tensor | None = None,
    resampled: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Systematic resampling of unnormalised weights ``[B, N]`` (``total`` ``[B]`` their row
    sums; None: the rows are normalised). Filters where ``resampled`` ``[B]`` is False get
    the identity. Writes the ancestors ``[B, N]`` (int64) into ``out`` if given."""
    B, N = weights.shape
    return SystematicResampler(B, N, weights.device, weights.dtype)(weights, total, resampled, generator, out)


def _check_weights(weights) -> None:
    """Weights ``[B, N]``: a floating tensor, finite, non-negative, every row with mass (the
    value checks device-side: no host read unless one fails)."""
    if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
        found = getattr(weights, "dtype", type(weights).__name__)
        raise TypeError(f"weights must be a floating torch.Tensor [B, N], got {found}")
    if weights.dim() != 2 or 0 in weights.shape:
        raise ValueError(f"weights must have shape [B, N], non-empty, got {tuple(weights.shape)}")
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return
    refuse_non_finite("weights", weights)
    refuse_unless(
        (weights >= 0).all() & (weights.sum(-1) > 0).all(),
        "weights must be non-negative with a positive sum in every row",
    )


def resample_indices(weights: torch.Tensor, method: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ancestor indices ``[B, N]`` for weights ``[B, N]`` (non-negative, each row with a
    positive sum: a row need not sum to 1)."""
    _check_weights(weights)
    return unchecked_resample_indices(weights, method, generator)


def unchecked_resample_indices(weights: torch.Tensor, method: str, generator=None) -> torch.Tensor:
    """``resample_indices`` of weights known to be valid (the filter's: finite, non-negative,
    the largest 1), without the checks (a dozen operators, on every call)."""
    B, N = weights.shape
    if method == "systematic":
        return systematic_ancestors(weights, generator=generator)
    if method == "multinomial":
        return torch.multinomial(weights, N, replacement=True, generator=generator)
    # residual and stratified read N w_j and cumsum(w) as fractions, in float64: a float32
    # cumulative sum is off by ~N eps per particle (biased counts at N ~ 1e5), and half
    # precision counts positions exactly only up to 256. Each row is scaled to sum 1, first
    # by its largest weight (a sum of huge weights may overflow; the largest is positive)
    device, dtype = weights.device, torch.float64
    weights = weights.to(dtype)
    weights = weights / weights.amax(-1, keepdim=True)
    weights = weights / weights.sum(-1, keepdim=True)
    if method == "residual":
        # floor(N w_j) deterministic copies of j fill the first D = sum_j copies_j slots (the
        # histogram-and-cumsum of the systematic resampler); the other N - D slots are drawn
        # from the residuals. N draws per filter are taken and the first N - D used: the number
        # differs per filter, and a fixed shape keeps it one batched call (no host sync).
        copies = torch.floor(N * weights)
        filled = copies.cumsum(-1)  # [B, N]
        slots = torch.arange(N, device=device, dtype=dtype).expand(B, N)
        deterministic = torch.searchsorted(filled.contiguous(), slots.contiguous(), right=True).clamp(max=N - 1)
        residual = (N * weights - copies).clamp(min=0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual, 1.0)  # no residual slot to fill: any valid row
        drawn = torch.multinomial(residual, N, replacement=True, generator=generator)
        used = filled[:, -1:]  # [B, 1] D
        from_residual = (slots - used).clamp(min=0).long()
        return torch.where(slots < used, deterministic, drawn.gather(1, from_residual))
    if method != "stratified":
        raise ValueError(f"unknown resampler {method!r}; allowed: {list(RESAMPLERS)}")
    # divided by its last entry: the last live particle's cumulative (and its dead
    # successors') is exactly 1, above every position, so none falls past it
    cumulative = weights.cumsum(-1)
    cumulative = cumulative / cumulative[:, -1:]
    positions = (
        torch.arange(N, device=device, dtype=dtype) + torch.rand(B, N, device=device, dtype=dtype, generator=generator)
    ) / N
    return torch.searchsorted(cumulative.contiguous(), positions.contiguous()).clamp(max=N - 1)


def relaxed_mixing(log_weights: torch.Tensor, relaxation: str, temperature: float, generator=None):
    """``(mixing [B, N, N], hard choice [B, N])``: new particle i = sum_j mixing[b, i, j]
    particle j, and the Gumbel-max ancestor it relaxes."""
    B, N = log_weights.shape
    uniform = torch.rand(B, N, N, device=log_weights.device, dtype=log_weights.dtype, generator=generator)
    gumbel = -(-uniform.clamp(min=1e-20).log()).log()
    scores = log_weights[:, None, :] + gumbel  # row i: the choice of new particle i
    soft = (scores / temperature).softmax(-1)
    hard_choice = scores.argmax(-1)
    if relaxation == "straight-through":
        hard = torch.nn.functional.one_hot(hard_choice, N).to(soft.dtype)
        return hard + soft - soft.detach(), hard_choice
    return soft, hard_choice


def gather(particles, ancestors):
    """Particles ``[B, N, ...]`` (or a dict of them) at the ancestors ``[B, N]``."""
    if isinstance(particles, dict):
        return {k: gather(v, ancestors) for k, v in particles.items()}
    if particles.requires_grad:
        # autograd saves the index; the filter's ancestors are a view of its [T, B, N] record,
        # which later steps write (a bumped version): gather from a copy
        ancestors = ancestors.clone()
    if particles.dim() == 2:
        return particles.gather(1, ancestors)
    index = ancestors.reshape(*ancestors.shape, *([1] * (particles.dim() - 2))).expand(
        *ancestors.shape, *particles.shape[2:]
    )
    return particles.gather(1, index)


def mix(particles, mixing):
    """New particle i = sum_j mixing[b, i, j] particle j."""
    if isinstance(particles, dict):
        return {k: mix(v, mixing) for k, v in particles.items()}
    flat = particles.reshape(*particles.shape[:2], -1)
    return (mixing.to(flat.dtype) @ flat).reshape(particles.shape)


def select(mask, new, old):
    """Per filter: ``new`` where mask[b] else ``old``."""
    if isinstance(new, dict):
        return {k: select(mask, new[k], old[k]) for k in new}
    return torch.where(mask.reshape(-1, *([1] * (new.dim() - 1))), new, old)
