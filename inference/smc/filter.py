"""Sequential Monte Carlo, batched over independent filters: particles ``[B, N, ...]``,
log-weights ``[B, N]``.

Each step propagates every particle and multiplies in its incremental weight; the
log-evidence grows by ``log sum_i W_i exp(inc_i)`` with W the normalised weights
before the step (so it stays unbiased across resampling); then every filter whose
ESS / N falls below ``ess_threshold`` resamples (its weights become uniform).

Resamplers and relaxations: ``inference.smc.resamplers``.

Two ways in:
    smc.filter(init, step, num_steps, batch_size=B)   plain tensor callables
    smc.filter(model, data)                            a Pyro state-space model object with
                                                       init(state, ...) / step(state, y):
                                                       pyro.infer.SMCFilter's interface
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference.smc.pyro_state_space import state_space_callables
from inference.smc.resamplers import (
    RELAXATIONS,
    RESAMPLERS,
    SystematicResampler,
    gather,
    mix,
    relaxed_mixing,
    resample_indices,
    select,
)

__all__ = ["SMC", "SMCResult", "RESAMPLERS", "RELAXATIONS", "resample_indices"]

# Limits: absurd sizes are refused before anything is allocated or looped over.
MAX_PARTICLES = 2**24  # N: the ancestors [T, B, N] and a relaxation's [B, N, N] scale with it
MAX_BATCH = 2**24  # B independent filters
MAX_PARTICLES_PER_STEP = 2**31  # B * N particles of one step
MAX_STEPS = 2**31  # T: a loop in Python, one step at a time
TEMPERATURES = (1e-6, 1e6)  # tau: scores / tau stays finite in float32 for scores up to ~1e32

LOG2_E = 1.0 / math.log(2.0)


@dataclass
class SMCResult:
    log_evidence: torch.Tensor  # [B]
    log_weights: torch.Tensor  # [B, N], normalised (logsumexp = 0)
    particles: object  # [B, N, ...] tensor, or a dict of them
    ess: torch.Tensor  # [T, B] before resampling
    ancestors: torch.Tensor | None  # [T, B, N]; identity where no resampling happened; None unrecorded
    resampled: torch.Tensor  # [T, B] bool


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
    largest (1) can resolve, and exp() of numbers whose exp is subnormal, or -inf, runs ~50x
    slower on CPUs (degenerate weights are full of them): exp of the value clamped at
    ``flush``, then 0 at or below ``flushed`` (just above exp(flush) in any rounding)."""
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


def _first_tensor(particles, where: str) -> torch.Tensor:
    """The first tensor of a particle state (a tensor, or a non-empty dict of tensors)."""
    if isinstance(particles, torch.Tensor):
        return particles
    if not isinstance(particles, dict):
        raise TypeError(f"{where} must return particles as a tensor [B, N, ...] or a dict of them, got {particles!r}")
    if not particles:
        raise ValueError(f"{where} returned an empty state: a particle state needs at least one tensor [B, N, ...]")
    for key, value in particles.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            raise TypeError(f"{where}: state[{key!r}] must be a tensor [B, N, ...], got {type(value).__name__}")
    return next(iter(particles.values()))


def _columns(per_step: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views ``[B, 1]`` of the rows of a per-step record ``[T, B]``."""
    return per_step.unsqueeze(2).unbind(0)


def _value(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor without its autograd history; itself when it has none (detach is a
    dispatch, a few microseconds, on every call)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_count(name: str, value, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer >= {minimum} and <= {maximum} (the limit), got {value!r}")


class SMC:
    """A batched particle filter.

    Args:
        num_particles: N >= 1.
        resample: one of ``RESAMPLERS``.
        ess_threshold: resample when ESS / N < threshold (1.0: always; 0: never).
        relaxation: None (hard resampling), "gumbel-softmax" or "straight-through".
        temperature: tau of the relaxations.
        generator: a ``torch.Generator`` for reproducible runs.
        validate: after a run, raise if any log-weight went NaN, +inf or all -inf (one
            host read per run; False: none, the caller checks ``log_evidence``).
        record_ancestors: keep every step's ancestors ``[T, B, N]`` (int64) in the result;
            False: ``SMCResult.ancestors`` is None, and a step writes its ancestors into one
            buffer of the run (T x B x N x 8 bytes less memory, and no writes to memory out
            of cache: 2-3% faster at B = 64, N = 1,000, T = 50 on one CPU thread).
    """

    def __init__(
        self,
        num_particles: int,
        resample: str = "systematic",
        ess_threshold: float = 0.5,
        relaxation: str | None = None,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        validate: bool = True,
        record_ancestors: bool = True,
    ):
        _check_count("num_particles", num_particles, 1, MAX_PARTICLES)
        if not isinstance(resample, str) or resample not in RESAMPLERS:
            raise ValueError(f"unknown resampler {resample!r}; allowed: {list(RESAMPLERS)}")
        if not _is_real(ess_threshold) or not 0 <= ess_threshold <= 1:
            raise ValueError(f"ess_threshold must be a number in [0, 1], got {ess_threshold!r}")
        if not (relaxation is None or isinstance(relaxation, str)) or relaxation not in RELAXATIONS:
            raise ValueError(f"unknown relaxation {relaxation!r}; allowed: {list(RELAXATIONS)}")
        low, high = TEMPERATURES
        if not _is_real(temperature) or not low <= temperature <= high:  # NaN fails both comparisons
            raise ValueError(f"temperature must be a finite number in [{low:g}, {high:g}], got {temperature!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.num_particles, self.resample, self.ess_threshold = num_particles, resample, ess_threshold
        self.relaxation, self.temperature, self.generator = relaxation, temperature, generator
        if not isinstance(validate, bool):
            raise ValueError(f"validate must be True or False, got {validate!r}")
        self.validate = validate
        if not isinstance(record_ancestors, bool):
            raise ValueError(f"record_ancestors must be True or False, got {record_ancestors!r}")
        self.record_ancestors = record_ancestors

    # ---- the core loop ----------------------------------------------------------------

    def filter(
        self, init, step=None, num_steps: int | None = None, batch_size: int | None = None, init_args=()
    ) -> SMCResult:
        """``filter(init, step, num_steps, batch_size=B)`` with tensor callables, or
        ``filter(model, data)`` / ``filter(model, data, batch_size=B)`` for a Pyro model
        object (data ``[T, ...]`` for one filter, ``[B, T, ...]`` for B filters), or
        ``filter(model, num_steps=T, batch_size=B, init_args=(...))`` for a model with no
        observations (``model.init(state, *init_args)``, ``model.step(state)``)."""
        if hasattr(init, "init") and hasattr(init, "step"):  # a Pyro model object, and its data
            model, data = init, step
            if data is None and num_steps is not None:
                _check_count("num_steps", num_steps, 0, MAX_STEPS)
            init, step, num_steps, batch_size = state_space_callables(
                model, data, batch_size, num_steps, init_args, self.num_particles
            )
            self._check_batch(batch_size)
            return self._run(init, step, num_steps, batch_size)
        if not callable(init) or not callable(step):
            raise TypeError("filter takes (init, step, num_steps) callables or (model, data) for a Pyro model")
        _check_count("num_steps", num_steps, 0, MAX_STEPS)
        batch_size = 1 if batch_size is None else batch_size
        self._check_batch(batch_size)
        return self._run(init, step, num_steps, batch_size)

    def _check_batch(self, batch_size) -> None:
        _check_count("batch_size", batch_size, 1, MAX_BATCH)
        if batch_size * self.num_particles > MAX_PARTICLES_PER_STEP:
            raise ValueError(
                f"batch_size x num_particles = {batch_size} x {self.num_particles} exceeds the limit "
                f"{MAX_PARTICLES_PER_STEP} (2**31) particles per step"
            )

    def _run(self, init: Callable, step: Callable, num_steps: int, batch_size: int) -> SMCResult:
        N = self.num_particles
        particles = init(batch_size)
        first = _first_tensor(particles, "init")
        B, device = first.shape[0], first.device
        dtype = first.dtype if first.dtype.is_floating_point else torch.get_default_dtype()
        if first.shape[1] != N:
            raise ValueError(f"init must return particles [B, N={N}, ...], got {tuple(first.shape)}")
        # unnormalised log-weights (the largest 0, or all 0) and their log-normaliser: the
        # normalisation is carried per filter ([B]), not applied to [B, N] every step
        log_weights = torch.zeros(B, N, device=device, dtype=dtype)
        log_n = math.log(N)
        # log Z = sum_t (top_t + log_total_t - log_norm_{t-1}), with log_norm_{-1} = log N and
        # log_norm_t = log N where step t resampled, else log_total_t: the logs and the choice
        # taken after the run, for all steps at once (two operators per step fewer)
        totals = []
        resampling = self.ess_threshold > 0  # decided in Python: "never" skips the work, nothing branches on data
        always = torch.ones(B, 1, device=device, dtype=dtype) if self.ess_threshold >= 1 else None
        ess_all = torch.empty(num_steps, B, device=device, dtype=dtype)
        # per step [B, 1], 1.0 where the filter resamples, else 0.0 (a number: the resampler and the
        # next step's weights take it as a factor, with no conversion per step; fresh tensors:
        # autograd saves them, and a write into a view of one [T, B] buffer would bump the version
        # they were saved at); stacked after the run
        resampled_steps = []
        # written in place step by step (no stack of T tensors at the end); never resampling,
        # every step's ancestors are the identity: a view, no memory
        record = resampling and self.record_ancestors
        ancestors_all = torch.empty(num_steps, B, N, device=device, dtype=torch.long) if record else None
        # bad weights are read off the row maxima after the loop (one host read per run, none
        # per step); a bad filter continues on finite weights meanwhile (NaN -> 0), so nothing
        # downstream (the resamplers) sees a NaN, and its evidence is NaN
        row_maxima = torch.empty(num_steps, B, device=device, dtype=dtype)
        lowest, flush, flushed = _limits(dtype)
        threshold = self.ess_threshold * N
        systematic = self.relaxation is None and self.resample == "systematic" and resampling

        def workspace(dtype):
            """Without autograd a step works in place on buffers of the run (the log-weights, the
            weights, the resampler's): nothing allocated, a working set that stays in cache. The
            resampler scales the weights in place: they are not read after it."""
            weights = torch.empty(B, N, device=device, dtype=dtype)
            return weights, SystematicResampler(B, N, device, dtype, weights, row_sums=True) if systematic else None

        weights_buffer, resampler = workspace(dtype)
        # one view per step, taken once (indexing in the loop costs a Python call per step);
        # per-filter values are columns [B, 1] in the loop: they broadcast against [B, N] with
        # no unsqueeze per use
        maxima_rows, ess_rows = _columns(row_maxima), _columns(ess_all)
        if record:
            ancestor_rows = ancestors_all.unbind(0)
        elif resampling:  # every step writes the same buffer (gather copies what autograd saves)
            ancestor_rows = (torch.empty(B, N, device=device, dtype=torch.long),) * num_steps
        else:
            ancestor_rows = None
        # [B, 1]: 0 where the last step resampled (its log-weights restart at 0), else 1; applied
        # with the next increment, in the same pass
        keep = None
        for t in range(num_steps):
            particles, increment = step(t, particles)
            if increment.shape != (B, N):
                raise ValueError(
                    f"step must return log-incremental weights [B, N] = {(B, N)}, got {tuple(increment.shape)}"
                )
            in_place = not (log_weights.requires_grad or increment.requires_grad) and increment.dtype == dtype
            if keep is None:
                joint = log_weights.add_(increment) if in_place else log_weights + increment
            else:
                joint = torch.addcmul(increment, log_weights, keep, out=log_weights if in_place else None)
            if joint.dtype != dtype:  # the increments promote the weights (float64 ones, float32 particles)
                dtype = joint.dtype
                row_maxima, ess_all = row_maxima.to(dtype), ess_all.to(dtype)
                maxima_rows, ess_rows = _columns(row_maxima), _columns(ess_all)
                lowest, flush, flushed = _limits(dtype)
                weights_buffer, resampler = workspace(dtype)
            top = torch.amax(_value(joint), -1, keepdim=True, out=maxima_rows[t])
            relative = joint.sub_(top).nan_to_num_(0.0, 0.0, lowest)  # the largest is 0
            # one exp per step gives log sum_i W_i exp(inc_i) (W normalised), the new weights and the
            # ESS; taken as 2 ** (x log2 e): on CPUs exp2 runs several times faster than exp
            # (docs/benchmarks.md), the multiplication is cheap, and the rounding of x log2 e moves
            # a weight by at most |x| eps relative (x >= flush)
            if in_place:
                unnormalised = torch.clamp_min(relative, flush, out=weights_buffer).mul_(LOG2_E).exp2_()
                torch.threshold_(unnormalised, flushed, 0.0)
            else:
                unnormalised = torch.threshold(relative.clamp_min(flush).mul(LOG2_E).exp2(), flushed, 0.0)
            total = unnormalised.sum(-1, keepdim=True)
            totals.append(total)
            weights, total_value = _value(unnormalised), _value(total)
            norm = torch.linalg.vector_norm(weights, dim=-1, keepdim=True)
            ess = torch.div(total_value, norm, out=ess_rows[t]).square_()
            if not resampling:
                log_weights = relative
                continue
            if always is None:
                chosen = torch.lt(ess, threshold, out=torch.empty(B, 1, device=device, dtype=dtype))
            else:
                chosen = always
            resampled_steps.append(chosen)
            if resampler is not None:
                ancestors = resampler(weights, total_value, chosen, self.generator, out=ancestor_rows[t])
                particles = gather(particles, ancestors)  # the identity rows gather themselves
            else:
                particles = self._resample(
                    particles, relative, total.log(), weights, total, chosen.bool(), ancestor_rows[t]
                )
            # all 0 where resampled (relative is finite), else relative: applied next step
            keep = torch.rsub(chosen, 1)
            log_weights = relative
        resampled_all = torch.zeros(num_steps, B, device=device, dtype=torch.bool)
        if resampled_steps:
            resampled_all = torch.stack(resampled_steps).squeeze(2).bool()
        first_bad = _first_bad(row_maxima, lowest)
        never = num_steps
        if self.validate:
            _raise_bad_weights(first_bad, never)
        # unvalidated: a filter whose weights went bad reports log-evidence NaN, never a number
        log_evidence = torch.zeros(B, device=device, dtype=dtype)
        normaliser = log_n  # [B, 1] or a number: log_norm of the last step
        if num_steps:
            log_totals = torch.stack(totals).log()  # [T, B, 1]
            log_norms = torch.where(resampled_all[..., None], log_n, log_totals) if resampling else log_totals
            normaliser = log_norms[-1]
            log_evidence = row_maxima.sum(0) + log_totals.sum(0).squeeze(1) - log_n
            log_evidence = log_evidence - log_norms[:-1].sum(0).squeeze(1)
        log_evidence = torch.where(first_bad.amin(0) < never, math.nan, log_evidence)
        # the last step's keep applied and the log-normaliser ([B, 1] after a step that could
        # resample) taken off in one pass (fresh: the result does not share the run's buffer);
        # zero weight (the lowest number) becomes -inf
        if keep is None:
            log_weights = log_weights - normaliser
        else:
            log_weights = torch.addcmul(normaliser.neg(), log_weights, keep)
        log_weights = torch.threshold_(log_weights, lowest / 2, -math.inf)
        return SMCResult(
            log_evidence=log_evidence,
            log_weights=log_weights,
            particles=particles,
            ess=ess_all,
            ancestors=ancestors_all if resampling else torch.arange(N, device=device).expand(num_steps, B, N),
            resampled=resampled_all,
        )

    def _resample(self, particles, relative, log_total, unnormalised, total, resampled, ancestors_out):
        """The new particles; the ancestors (identity in filters that do not resample) are
        written into ``ancestors_out``. Per-filter values (``log_total``, ``total``,
        ``resampled``) are columns [B, 1]."""
        B, N = unnormalised.shape
        identity = torch.arange(N, device=unnormalised.device).expand(B, N)
        if self.relaxation is None:
            drawn = resample_indices(unnormalised / total.detach(), self.resample, self.generator)
            ancestors = torch.where(resampled, drawn, identity, out=ancestors_out)
            return gather(particles, ancestors)
        log_weights = relative - log_total
        mixing, hard_choice = relaxed_mixing(log_weights, self.relaxation, self.temperature, self.generator)
        torch.where(resampled, hard_choice, identity, out=ancestors_out)
        return select(resampled, mix(particles, mixing), particles)
