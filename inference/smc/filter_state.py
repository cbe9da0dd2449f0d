"""What one run of the batched particle filter (``inference.smc.filter``) carries from step to
step, so that the filter's loop reads as the algorithm.

``LogWeights``: the log-weights ``[B, N]`` of B filters and the buffers a step weighs them on
(the incremental weight multiplied in, the largest weight scaled to 1, the ESS), restarted
where a filter resampled. ``Trace``: the per-step records, preallocated (row maxima and ESS
``[T, B]``, the resampling choices, the ancestors ``[T, B, N]``), and what is read off them
after the run: the first bad weights and the log-evidence.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from inference.smc.resamplers import SystematicResampler

__all__ = ["LogWeights", "Trace", "Weighed"]

LOG2_E = 1.0 / math.log(2.0)

# the three ways log-weights go bad, in the order they are reported
_BAD_WEIGHTS = (
    "log-weights contain NaN (a NaN increment, or +inf on a particle of weight 0)",
    "log-weights contain +inf",
    "every particle has zero weight (all log-weights -inf)",
)


def _first_bad(row_maxima: torch.Tensor, lowest: float) -> torch.Tensor:
    """``[3, B]``: the first step where each filter's log-weights went NaN, +inf or all zero
    weight (``T`` if never), read off the row maxima ``[T, B]`` of the new log-weights of
    every step (amax propagates NaN) once after the run. Zero weight is -inf or, carried
    inside the loop, the lowest finite number (plus any increment short of overflow)."""
    T, B = row_maxima.shape
    if T == 0:
        return torch.zeros(3, B, device=row_maxima.device, dtype=torch.long)
    bad = torch.stack([row_maxima.isnan(), row_maxima == math.inf, row_maxima <= lowest / 2])  # [3, T, B]
    steps = torch.arange(T, device=row_maxima.device)[:, None]
    return torch.where(bad, steps, T).amin(1)


def _limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(lowest, flush, flushed)``. Zero weight is carried as the lowest finite number inside
    the loop, so that a row is reset to uniform by arithmetic (0 * -inf would be NaN); it is
    reported as -inf. Relative weights below sqrt(smallest normal number) (log: ``flush``)
    are flushed to exactly 0: they are far below what a sum or a cumulative sum against the
    largest (1) can resolve, and exp() of numbers whose exp is subnormal, or -inf, runs far
    slower on CPUs (docs/benchmarks.md; degenerate weights are full of them): exp of the
    value clamped at ``flush``, then 0 at or below ``flushed`` (just above exp(flush) in any
    rounding)."""
    info = torch.finfo(dtype)
    flush = math.log(info.tiny) / 2
    return info.min, flush, math.exp(flush) * 1.001


def _raise_bad_weights(first_bad: torch.Tensor, never: int) -> None:
    """One host read at the end of a run: the first step and filters where weights went bad."""
    steps = first_bad.amin(-1).tolist()
    for kind, step in zip(_BAD_WEIGHTS, steps):
        if step < never:
            filters = (first_bad[_BAD_WEIGHTS.index(kind)] < never).nonzero().flatten().tolist()
            raise ValueError(f"{kind}: first at step {step}, in filters {filters}")


def _columns(per_step: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views ``[B, 1]`` of the rows of a per-step record ``[T, B]``."""
    return per_step.unsqueeze(2).unbind(0)


def _value(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor without its autograd history; itself when it has none (detach is a
    dispatch, a few microseconds, on every call)."""
    return tensor.detach() if tensor.requires_grad else tensor


class Weighed(NamedTuple):
    """One step's weights. ``relative``: the log-weights ``[B, N]`` (the largest 0);
    ``total``: the sum ``[B, 1]`` of their exponentials (with its autograd history);
    ``weights`` and ``total_value``: the exponentials ``[B, N]`` and ``total`` without it;
    ``ess``: ``[B, 1]``."""

    relative: torch.Tensor
    weights: torch.Tensor
    total: torch.Tensor
    total_value: torch.Tensor
    ess: torch.Tensor


class Trace:
    """The per-step records of a run of ``num_steps`` steps, written in place step by step (no
    stack of T tensors at the end). Per-filter values are columns ``[B, 1]`` in the loop: they
    broadcast against ``[B, N]`` with no unsqueeze per use; one view per step, taken once
    (indexing in the loop costs a Python call per step).

    ``ancestors``: "record" keeps every step's ancestors ``[T, B, N]``; "reuse": every step
    writes the same buffer (gather copies what autograd saves); None: no resampling, every
    step's ancestors are the identity (a view, no memory)."""

    def __init__(self, num_steps: int, batch: int, num_particles: int, device, dtype, ancestors: str | None):
        self.num_steps, self.batch, self.num_particles, self.device = num_steps, batch, num_particles, device
        self.resampling = ancestors is not None
        # bad weights are read off the row maxima after the loop (one host read per run, none
        # per step); a bad filter continues on finite weights meanwhile (NaN -> 0), so nothing
        # downstream (the resamplers) sees a NaN, and its evidence is NaN
        self.row_maxima = torch.empty(num_steps, batch, device=device, dtype=dtype)
        self.ess = torch.empty(num_steps, batch, device=device, dtype=dtype)
        self.retype(dtype)
        # log Z = sum_t (top_t + log_total_t - log_norm_{t-1}), with log_norm_{-1} = log N and
        # log_norm_t = log N where step t resampled, else log_total_t: the logs and the choice
        # taken after the run, for all steps at once (two operators per step fewer)
        self.totals = []
        self.initial_total = None  # [B]: log sum exp of the weights the run starts from, if not uniform
        # per step [B, 1], 1.0 where the filter resamples, else 0.0 (a number: the resampler and the
        # next step's weights take it as a factor, with no conversion per step); stacked after the
        # run. The filter decides into ``choice_rows``, views of one buffer [T, B] (no allocation
        # per step): autograd saves no choice (the next weights' factor, 1 - choice, is a fresh
        # tensor), so later writes into the buffer bump no version it checks
        self.choices = []
        shape = (num_steps, batch, num_particles)
        self.ancestors = torch.empty(shape, device=device, dtype=torch.long) if ancestors == "record" else None
        if self.ancestors is not None:
            self.ancestor_rows = self.ancestors.unbind(0)
        elif ancestors == "reuse":
            self.ancestor_rows = (torch.empty(shape[1:], device=device, dtype=torch.long),) * num_steps
        else:
            self.ancestor_rows = None
            self.ancestors = torch.arange(num_particles, device=device).expand(shape)

    def retype(self, dtype: torch.dtype) -> None:
        """The float records in ``dtype`` (the increments promote the weights: float64 ones,
        float32 particles), and their views per step."""
        self.dtype = dtype
        self.row_maxima, self.ess = self.row_maxima.to(dtype), self.ess.to(dtype)
        self.maxima_rows, self.ess_rows = _columns(self.row_maxima), _columns(self.ess)
        self.choice_rows = _columns(torch.empty(self.num_steps, self.batch, device=self.device, dtype=dtype))

    def resampled(self) -> torch.Tensor:
        """``[T, B]`` bool: where a filter resampled."""
        if not self.choices:
            return torch.zeros(self.num_steps, self.batch, device=self.device, dtype=torch.bool)
        return torch.stack(self.choices).squeeze(2).bool()

    def log_evidence(self, resampled: torch.Tensor, validate: bool):
        """``(log_evidence [B], normaliser)``: the evidence of every filter (NaN where its weights
        went bad; ``validate``: raise instead) and the log-normaliser of the last step's weights
        (``[B, 1]``, or log N before any step)."""
        T, log_n = self.num_steps, math.log(self.num_particles)
        if T == 0 and self.initial_total is not None:  # no step: importance sampling from the init
            return self._initial_evidence(validate)
        first_bad = _first_bad(self.row_maxima, _limits(self.dtype)[0])
        if validate:
            _raise_bad_weights(first_bad, T)
        # unvalidated: a filter whose weights went bad reports log-evidence NaN, never a number
        log_evidence = torch.zeros(self.batch, device=self.device, dtype=self.dtype)
        normaliser = log_n
        if T:
            log_totals = torch.stack(self.totals).log()  # [T, B, 1]
            log_norms = torch.where(resampled[..., None], log_n, log_totals) if self.resampling else log_totals
            normaliser = log_norms[-1]
            log_evidence = self.row_maxima.sum(0) + log_totals.sum(0).squeeze(1) - log_n
            log_evidence = log_evidence - log_norms[:-1].sum(0).squeeze(1)
        return torch.where(first_bad.amin(0) < T, math.nan, log_evidence), normaliser

    def _initial_evidence(self, validate: bool):
        """``log_evidence`` and normaliser of a run of no step from weights that were not uniform."""
        total = self.initial_total.to(self.dtype)
        bad = ~total.isfinite()  # NaN, +inf, or every weight 0
        if validate and bad.any():
            filters = bad.nonzero().flatten().tolist()
            raise ValueError(f"the log-weights init returned are NaN, +inf or all -inf, in filters {filters}")
        return torch.where(bad, math.nan, total - math.log(self.num_particles)), total[:, None]


class LogWeights:
    """The unnormalised log-weights ``[B, N]`` of B filters (the largest 0, or all 0) and their
    log-normaliser, carried per filter (``[B]``, in the trace), not applied to ``[B, N]``
    every step.

    ``systematic``: the filter resamples systematically, on a ``SystematicResampler`` that
    shares this object's weights buffer (``resampler``; else None)."""

    def __init__(self, batch: int, num_particles: int, device, dtype, systematic: bool):
        self.shape, self.device, self.systematic = (batch, num_particles), device, systematic
        self.log_weights = torch.zeros(batch, num_particles, device=device, dtype=dtype)
        # [B, 1]: 0 where the last step resampled (its log-weights restart at 0), else 1; applied
        # with the next increment, in the same pass
        self.keep = None
        self.retype(dtype)

    def retype(self, dtype: torch.dtype) -> None:
        """Buffers in ``dtype``. Without autograd a step works in place on buffers of the run (the
        log-weights, the weights, the resampler's): nothing allocated, a working set that stays in
        cache. The resampler scales the weights in place: they are not read after it."""
        self.dtype = dtype
        self.lowest, self.flush, self.flushed = _limits(dtype)
        self.buffer = torch.empty(self.shape, device=self.device, dtype=dtype)
        self.resampler = None
        if self.systematic:
            self.resampler = SystematicResampler(*self.shape, self.device, dtype, self.buffer, row_sums=True)

    def start_from(self, log_weights: torch.Tensor, trace: Trace) -> None:
        """Start from ``log_weights`` ``[B, N]`` (a model's init that observed), not from 0: the
        first step multiplies its increment into them."""
        if log_weights.shape != self.shape:
            found = tuple(log_weights.shape)
            raise ValueError(f"init's log-weights must have shape [B, N] = {self.shape}, got {found}")
        dtype = torch.promote_types(self.dtype, log_weights.dtype)
        if dtype != self.dtype:
            self.retype(dtype)
            trace.retype(dtype)
        self.log_weights = log_weights.to(dtype, copy=True)  # the first step may add into it in place
        if trace.num_steps == 0:  # the evidence of a run of no step is theirs alone
            trace.initial_total = torch.logsumexp(self.log_weights, -1)

    def weigh(self, increment: torch.Tensor, trace: Trace, t: int) -> Weighed:
        """Multiply in step ``t``'s incremental weights ``[B, N]``: the new log-weights (the
        largest 0), their exponentials and the ESS; row maxima, ESS and totals go to ``trace``."""
        in_place = not (self.log_weights.requires_grad or increment.requires_grad) and increment.dtype == self.dtype
        if self.keep is None:
            joint = self.log_weights.add_(increment) if in_place else self.log_weights + increment
        else:
            out = self.log_weights if in_place else None
            joint = torch.addcmul(increment, self.log_weights, self.keep, out=out)
        if joint.dtype != self.dtype:  # the increments promote the weights (float64 ones, float32 particles)
            self.retype(joint.dtype)
            trace.retype(joint.dtype)
        top = torch.amax(_value(joint), -1, keepdim=True, out=trace.maxima_rows[t])
        relative = joint.sub_(top).nan_to_num_(0.0, 0.0, self.lowest)  # the largest is 0
        unnormalised = self._exp(relative, in_place)
        total = unnormalised.sum(-1, keepdim=True)
        trace.totals.append(total)
        weights, total_value = _value(unnormalised), _value(total)
        norm = torch.linalg.vector_norm(weights, dim=-1, keepdim=True)
        ess = torch.div(total_value, norm, out=trace.ess_rows[t]).square_()
        self.log_weights = relative
        return Weighed(relative, weights, total, total_value, ess)

    def _exp(self, relative: torch.Tensor, in_place: bool) -> torch.Tensor:
        """The weights, 0 below ``flushed``. One exp per step gives log sum_i W_i exp(inc_i) (W
        normalised), the new weights and the ESS; taken as 2 ** (x log2 e): on CPUs exp2 runs
        several times faster than exp (docs/benchmarks.md), the multiplication is cheap, and the
        rounding of x log2 e moves a weight by at most |x| eps relative (x >= flush)."""
        if in_place:
            unnormalised = torch.clamp_min(relative, self.flush, out=self.buffer).mul_(LOG2_E).exp2_()
            return torch.threshold_(unnormalised, self.flushed, 0.0)
        return torch.threshold(relative.clamp_min(self.flush).mul(LOG2_E).exp2(), self.flushed, 0.0)

    def restart(self, chosen: torch.Tensor) -> None:
        """The log-weights of the filters that resampled (``chosen`` 1.0, ``[B, 1]``) restart at
        0 with the next increment: all 0 there (the log-weights are finite), else unchanged."""
        self.keep = torch.rsub(chosen, 1)

    def normalised(self, normaliser) -> torch.Tensor:
        """The log-weights after the run (logsumexp 0): the last step's ``keep`` applied and the
        log-normaliser taken off in one pass (fresh: the result does not share the run's
        buffer); zero weight (the lowest number) becomes -inf."""
        if self.keep is None:
            log_weights = self.log_weights - normaliser
        else:
            log_weights = torch.addcmul(normaliser.neg(), self.log_weights, self.keep)
        return torch.threshold_(log_weights, self.lowest / 2, -math.inf)
