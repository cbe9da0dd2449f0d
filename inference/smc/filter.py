"""Sequential Monte Carlo, batched over independent filters: particles ``[B, N, ...]``,
log-weights ``[B, N]``.

Each step propagates every particle and multiplies in its incremental weight; the
log-evidence grows by ``log sum_i W_i exp(inc_i)`` with W the normalised weights
before the step (so it stays unbiased across resampling); then every filter whose
ESS / N falls below ``ess_threshold`` resamples (its weights become uniform).

A step reads as the algorithm: move (the model's step), weigh, decide, resample
(``SMC._run``). The log-weights a run carries and its per-step records:
``inference.smc.filter_state``; resamplers and relaxations: ``inference.smc.resamplers``.

Two ways in:
    smc.filter(init, step, num_steps, batch_size=B)   plain tensor callables
    smc.filter(model, data)                            a Pyro state-space model object with
                                                       init(state, ...) / step(state, y):
                                                       pyro.infer.SMCFilter's interface
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphs.limits import is_real
from inference.smc.filter_state import LogWeights, Trace, Weighed
from inference.smc.pyro_state_space import state_space_callables
from inference.smc.resamplers import (
    RELAXATIONS,
    RESAMPLERS,
    gather,
    mix,
    relaxed_mixing,
    resample_indices,
    select,
    unchecked_resample_indices,
)

__all__ = ["SMC", "SMCResult", "RESAMPLERS", "RELAXATIONS", "resample_indices"]

# Limits: absurd sizes are refused before anything is allocated or looped over.
MAX_PARTICLES = 2**24  # N: the ancestors [T, B, N] and a relaxation's [B, N, N] scale with it
MAX_BATCH = 2**24  # B independent filters
MAX_PARTICLES_PER_STEP = 2**31  # B * N particles of one step
MAX_STEPS = 2**31  # T: a loop in Python, one step at a time
# entries of each record allocated before the run (ESS [T, B], ancestors [T, B, N]): 8 GiB of
# int64, room for a large GPU run; past it, record_ancestors=False keeps no [T, B, N] record
MAX_RECORDS = 2**30
TEMPERATURES = (1e-6, 1e6)  # tau: scores / tau stays finite in float32 for scores up to ~1e32


@dataclass
class SMCResult:
    log_evidence: torch.Tensor  # [B]
    log_weights: torch.Tensor  # [B, N], normalised (logsumexp = 0)
    particles: object  # [B, N, ...] tensor, or a dict of them
    ess: torch.Tensor  # [T, B] before resampling
    ancestors: torch.Tensor | None  # [T, B, N]; identity where no resampling happened; None unrecorded
    resampled: torch.Tensor  # [T, B] bool


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
            of cache: a little faster; docs/benchmarks.md, "SMC vs SMCFilter").
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
        if not is_real(ess_threshold) or not 0 <= ess_threshold <= 1:
            raise ValueError(f"ess_threshold must be a number in [0, 1], got {ess_threshold!r}")
        if not (relaxation is None or isinstance(relaxation, str)) or relaxation not in RELAXATIONS:
            raise ValueError(f"unknown relaxation {relaxation!r}; allowed: {list(RELAXATIONS)}")
        low, high = TEMPERATURES
        if not is_real(temperature) or not low <= temperature <= high:  # NaN fails both comparisons
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
            self._check_batch(batch_size, num_steps)
            return self._run(init, step, num_steps, batch_size, weighs_init=True)
        if not callable(init) or not callable(step):
            raise TypeError("filter takes (init, step, num_steps) callables or (model, data) for a Pyro model")
        _check_count("num_steps", num_steps, 0, MAX_STEPS)
        batch_size = 1 if batch_size is None else batch_size
        self._check_batch(batch_size, num_steps)
        return self._run(init, step, num_steps, batch_size)

    def _check_batch(self, batch_size, num_steps: int) -> None:
        _check_count("batch_size", batch_size, 1, MAX_BATCH)
        if batch_size * self.num_particles > MAX_PARTICLES_PER_STEP:
            raise ValueError(
                f"batch_size x num_particles = {batch_size} x {self.num_particles} exceeds the limit "
                f"{MAX_PARTICLES_PER_STEP} (2**31) particles per step"
            )
        # the records are allocated before the first step: ess [T, B], and the ancestors [T, B, N]
        recorded = self.record_ancestors and self.ess_threshold > 0
        entries = num_steps * batch_size * (self.num_particles if recorded else 1)
        if entries > MAX_RECORDS:
            what = (
                "num_steps x batch_size x num_particles (the ancestors [T, B, N])"
                if recorded
                else "num_steps x batch_size (the ESS [T, B])"
            )
            fix = "; record_ancestors=False keeps no [T, B, N] record" if recorded else ""
            raise ValueError(f"{what} = {entries} exceeds the limit {MAX_RECORDS} (2**30) entries{fix}")

    def _run(
        self, init: Callable, step: Callable, num_steps: int, batch_size: int, weighs_init: bool = False
    ) -> SMCResult:
        """Every step: move (the model's transition, with its incremental weights), weigh,
        decide (ESS against the threshold), resample. ``weighs_init``: ``init`` returns
        ``(particles, log-weights [B, N])`` (a model whose init observes), multiplied into the
        first step's weights (a run of no step: importance sampling from the init)."""
        N, particles = self.num_particles, init(batch_size)
        initial = None
        if weighs_init:
            particles, initial = particles
        B, device, dtype = _check_init(particles, N, batch_size)
        resampling = self.ess_threshold > 0  # decided in Python: "never" skips the work, nothing branches on data
        ancestors = ("record" if self.record_ancestors else "reuse") if resampling else None
        trace = Trace(num_steps, B, N, device, dtype, ancestors)
        systematic = self.relaxation is None and self.resample == "systematic" and resampling
        log_weights = LogWeights(B, N, device, dtype, systematic)
        if initial is not None:
            log_weights.start_from(initial, trace)
        always = torch.ones(B, 1, device=device, dtype=dtype) if self.ess_threshold >= 1 else None
        # the ancestors of a filter that does not resample, for the resamplers that select them (the
        # systematic one gives them by arithmetic)
        identity = torch.arange(N, device=device).expand(B, N) if resampling and not systematic else None
        for t in range(num_steps):
            particles, increment = _move(step, t, particles, (B, N), device)
            weighed = log_weights.weigh(increment, trace, t)
            if not resampling:
                continue
            chosen = self._decide(weighed.ess, always, out=trace.choice_rows[t])
            trace.choices.append(chosen)
            log_weights.restart(chosen)  # the next step's factor; the systematic resampler takes it too
            particles = self._resample(particles, weighed, chosen, log_weights, trace.ancestor_rows[t], identity)
        resampled = trace.resampled()
        log_evidence, normaliser = trace.log_evidence(resampled, self.validate)
        return SMCResult(
            log_evidence=log_evidence,
            log_weights=log_weights.normalised(normaliser),
            particles=particles,
            ess=trace.ess,
            ancestors=trace.ancestors,
            resampled=resampled,
        )

    def _decide(self, ess: torch.Tensor, always: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, 1]``: 1.0 where a filter resamples (ESS / N below ``ess_threshold``; ``always``
        at a threshold of 1), else 0.0; written into ``out`` (``ess``'s shape and dtype) if given."""
        if always is not None:
            return always
        threshold = self.ess_threshold * self.num_particles
        if out is None:
            out = torch.empty(ess.shape, device=ess.device, dtype=ess.dtype)
        return torch.lt(ess, threshold, out=out)

    def _resample(
        self, particles, weighed: Weighed, chosen: torch.Tensor, log_weights: LogWeights, ancestors_out, identity
    ):
        """The new particles of the filters that resample (``chosen`` 1.0, ``[B, 1]``), the others
        as they were; the ancestors (``identity`` ``[B, N]`` in filters that do not resample) are
        written into ``ancestors_out``. ``log_weights``: the run's, restarted after ``chosen``
        (its ``resampler``: the run's ``SystematicResampler``, or None)."""
        resampler = log_weights.resampler
        if resampler is not None:
            ancestors = resampler(
                weighed.weights, weighed.total_value, chosen, self.generator, out=ancestors_out, kept=log_weights.keep
            )
            return gather(particles, ancestors)  # the identity rows gather themselves
        resampled = chosen.bool()
        if self.relaxation is None:  # the weights are valid: finite, non-negative, the largest 1
            drawn = unchecked_resample_indices(weighed.weights / weighed.total_value, self.resample, self.generator)
            ancestors = torch.where(resampled, drawn, identity, out=ancestors_out)
            return gather(particles, ancestors)
        log_weights = weighed.relative - weighed.total.log()
        mixing, hard_choice = relaxed_mixing(log_weights, self.relaxation, self.temperature, self.generator)
        torch.where(resampled, hard_choice, identity, out=ancestors_out)
        return select(resampled, mix(particles, mixing), particles)


def _check_init(particles, num_particles: int, batch_size: int) -> tuple[int, torch.device, torch.dtype]:
    """``(B, device, dtype)`` of the particles ``init`` returned (``[B, N, ...]``); the weights'
    dtype is the particles' if floating point, else the default, and at least float32 (a
    half-precision weight cannot tell apart the relative weights the filter keeps)."""
    first = _first_tensor(particles, "init")
    if first.dim() < 2 or first.shape[:2] != (batch_size, num_particles):
        raise ValueError(
            f"init must return particles [B={batch_size}, N={num_particles}, ...] (batch_size, num_particles), "
            f"got {tuple(first.shape)}"
        )
    dtype = first.dtype if first.dtype.is_floating_point else torch.get_default_dtype()
    return first.shape[0], first.device, torch.promote_types(dtype, torch.float32)


def _move(step: Callable, t: int, particles, shape: tuple[int, int], device: torch.device):
    """The model's step ``t``: the particles moved, and their incremental log-weights ``[B, N]``
    (a tensor on the particles' ``device``)."""
    moved = step(t, particles)
    if not isinstance(moved, tuple | list) or len(moved) != 2:
        raise TypeError(f"step must return (particles, log-incremental weights [B, N]), got {type(moved).__name__}")
    particles, increment = moved
    if not isinstance(increment, torch.Tensor):
        raise TypeError(f"step must return log-incremental weights as a tensor [B, N], got {type(increment).__name__}")
    if increment.shape != shape:
        raise ValueError(f"step must return log-incremental weights [B, N] = {shape}, got {tuple(increment.shape)}")
    if increment.device != device:
        raise ValueError(
            f"step must return log-incremental weights on the particles' device {device}, got {increment.device} "
            f"(at step {t})"
        )
    return particles, increment
