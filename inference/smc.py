"""Sequential Monte Carlo, batched over independent filters: particles ``[B, N, ...]``,
log-weights ``[B, N]``.

Each step propagates every particle and multiplies in its incremental weight; the
log-evidence grows by ``log sum_i W_i exp(inc_i)`` with W the normalised weights
before the step (so it stays unbiased across resampling); then every filter whose
ESS / N falls below ``ess_threshold`` resamples (its weights become uniform).

Resamplers (offspring counts have expectation N w_i): multinomial, stratified,
systematic, residual. Relaxations for training through resampling:
``"gumbel-softmax"`` (each new particle is a softmax((log w + Gumbel) / tau) mixture
of the old ones) and ``"straight-through"`` (the hard Gumbel-max choice forward, the
soft mixture's gradient backward).

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

import pyro
import torch
from pyro import poutine

__all__ = ["SMC", "SMCResult", "RESAMPLERS", "RELAXATIONS", "resample_indices"]

RESAMPLERS = ("multinomial", "stratified", "systematic", "residual")
RELAXATIONS = (None, "gumbel-softmax", "straight-through")

# Limits (issue 17): absurd sizes are refused before anything is allocated or looped over.
MAX_PARTICLES = 2**24  # N: the ancestors [T, B, N] and a relaxation's [B, N, N] scale with it
MAX_BATCH = 2**24  # B independent filters
MAX_PARTICLES_PER_STEP = 2**31  # B * N particles of one step
MAX_STEPS = 2**31  # T: a loop in Python, one step at a time
TEMPERATURES = (1e-6, 1e6)  # tau: scores / tau stays finite in float32 for scores up to ~1e32


@dataclass
class SMCResult:
    log_evidence: torch.Tensor  # [B]
    log_weights: torch.Tensor  # [B, N], normalised (logsumexp = 0)
    particles: object  # [B, N, ...] tensor, or a dict of them
    ess: torch.Tensor  # [T, B] before resampling
    ancestors: torch.Tensor  # [T, B, N]; identity where no resampling happened
    resampled: torch.Tensor  # [T, B] bool


# the three ways log-weights go bad, in the order they are reported
_BAD_WEIGHTS = (
    "log-weights contain NaN (a NaN increment, or +inf on a particle of weight 0)",
    "log-weights contain +inf",
    "every particle has zero weight (all log-weights -inf)",
)


def _bad_weights(joint_max: torch.Tensor) -> torch.Tensor:
    """``[3, B]`` per filter: NaN, +inf, every particle at -inf, read off the row maxima of
    the new log-weights (amax propagates NaN) that the step computes anyway. No sync."""
    return torch.stack([joint_max.isnan(), joint_max == math.inf, joint_max == -math.inf])


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


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_count(name: str, value, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer >= {minimum} and <= {maximum} (the limit), got {value!r}")


def resample_indices(weights: torch.Tensor, method: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ancestor indices ``[B, N]`` for normalised weights ``[B, N]``."""
    B, N = weights.shape
    device, dtype = weights.device, weights.dtype
    if method == "multinomial":
        return torch.multinomial(weights, N, replacement=True, generator=generator)
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
    cumulative = weights.cumsum(-1)
    cumulative[:, -1] = 1.0  # guard against rounding below the last position
    if method == "systematic":
        # Positions (i + u) / N pass particle j's cumulative weight c_j exactly for
        # i >= floor(N c_j - u) + 1, so ancestor_i = #{j : that threshold <= i}: a
        # histogram and a cumsum, O(N) instead of a binary search per position.
        u = torch.rand(B, 1, device=device, dtype=dtype, generator=generator)
        # floor(N c_j - u) + 1 = floor(N c_j + 1 - u): positive, so truncation is the floor
        first = torch.add(1 - u, cumulative, alpha=N).clamp_(max=N).long()
        ones = torch.ones((), device=device, dtype=torch.long).expand_as(first)
        counts = torch.zeros(B, N + 1, device=device, dtype=torch.long).scatter_add_(1, first, ones)
        return counts[:, :N].cumsum(-1).clamp_(max=N - 1)
    if method != "stratified":
        raise ValueError(f"unknown resampler {method!r}; allowed: {list(RESAMPLERS)}")
    positions = (
        torch.arange(N, device=device, dtype=dtype) + torch.rand(B, N, device=device, dtype=dtype, generator=generator)
    ) / N
    return torch.searchsorted(cumulative.contiguous(), positions.contiguous()).clamp(max=N - 1)


def _gather(particles, ancestors):
    if isinstance(particles, dict):
        return {k: _gather(v, ancestors) for k, v in particles.items()}
    index = ancestors.reshape(*ancestors.shape, *([1] * (particles.dim() - 2))).expand(
        *ancestors.shape, *particles.shape[2:]
    )
    return particles.gather(1, index)


def _mix(particles, mixing):
    """New particle i = sum_j mixing[b, i, j] particle j."""
    if isinstance(particles, dict):
        return {k: _mix(v, mixing) for k, v in particles.items()}
    flat = particles.reshape(*particles.shape[:2], -1)
    return (mixing.to(flat.dtype) @ flat).reshape(particles.shape)


def _select(mask, new, old):
    """Per filter: ``new`` where mask[b] else ``old``."""
    if isinstance(new, dict):
        return {k: _select(mask, new[k], old[k]) for k in new}
    return torch.where(mask.reshape(-1, *([1] * (new.dim() - 1))), new, old)


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

    # ---- the core loop ----------------------------------------------------------------

    def filter(
        self, init, step=None, num_steps: int | None = None, batch_size: int | None = None, init_args=()
    ) -> SMCResult:
        """``filter(init, step, num_steps, batch_size=B)`` with tensor callables, or
        ``filter(model, data)`` / ``filter(model, data, batch_size=B)`` for a Pyro model
        object (data ``[T, ...]`` for one filter, ``[B, T, ...]`` for B filters), or
        ``filter(model, num_steps=T, batch_size=B, init_args=(...))`` for a model with no
        observations (``model.init(state, *init_args)``, ``model.step(state)``)."""
        if hasattr(init, "init") and hasattr(init, "step"):
            return self._filter_pyro(init, step, batch_size, num_steps, init_args)
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
        log_weights = torch.full((B, N), -math.log(N), device=device, dtype=dtype)
        log_evidence = torch.zeros(B, device=device, dtype=dtype)
        identity = torch.arange(N, device=device).expand(B, N)
        resampling = self.ess_threshold > 0  # decided in Python: "never" skips the work, nothing branches on data
        ess_all = torch.empty(num_steps, B, device=device, dtype=dtype)
        resampled_all = torch.zeros(num_steps, B, device=device, dtype=torch.bool)
        # written in place step by step (no stack of T tensors at the end); never resampling,
        # every step's ancestors are the identity: a view, no memory
        ancestors_all = torch.empty(num_steps, B, N, device=device, dtype=torch.long) if resampling else None
        # bad weights are recorded on the device and reported after the loop (one host read
        # per run, none per step); a bad filter continues on uniform weights meanwhile, so
        # nothing downstream (the resamplers) sees a NaN
        never = num_steps
        first_bad = torch.full((len(_BAD_WEIGHTS), B), never, device=device, dtype=torch.long)
        # relative weights below sqrt(smallest normal number) are flushed to exactly 0: they are
        # far below what a sum or a cumulative sum against the largest (1) can resolve, and
        # exp() and squares of subnormal numbers run ~10x slower on CPUs (degenerate weights
        # are full of them)
        flush = math.log(torch.finfo(dtype).tiny) / 2
        for t in range(num_steps):
            particles, increment = step(t, particles)
            if increment.shape != (B, N):
                raise ValueError(
                    f"step must return log-incremental weights [B, N] = {(B, N)}, got {tuple(increment.shape)}"
                )
            joint = log_weights + increment
            top = joint.detach().amax(-1)
            bad = _bad_weights(top)
            first_bad = torch.where(bad, first_bad.clamp(max=t), first_bad)
            failed = bad.any(0)
            top = torch.where(failed, 0.0, top)
            relative = joint.sub_(top[:, None]).masked_fill_(failed[:, None], 0.0)  # a failed filter: uniform
            # one exp per step gives log sum_i W_i exp(inc_i) (W normalised), the new weights and the ESS
            unnormalised = relative.masked_fill(relative <= flush, -math.inf).exp_()  # the largest is 1
            total = unnormalised.sum(-1)
            log_total = total.log()
            log_evidence = log_evidence + top + log_total
            log_weights = relative - log_total[:, None]
            ess = total * total / (unnormalised[:, None, :] @ unnormalised[:, :, None]).flatten()  # one pass
            ess_all[t] = ess.detach()
            if resampling:
                resampled = ess < self.ess_threshold * N
                if self.ess_threshold >= 1:
                    resampled = torch.ones_like(resampled)
                weights = (unnormalised / total[:, None]).detach()
                particles = self._resample(particles, log_weights, weights, resampled, ancestors_all[t], identity)
                log_weights = torch.where(resampled[:, None], -math.log(N), log_weights)
                resampled_all[t] = resampled
        if self.validate:
            _raise_bad_weights(first_bad, never)
        # unvalidated: a filter whose weights went bad reports log-evidence NaN, never a number
        log_evidence = torch.where(first_bad.amin(0) < never, math.nan, log_evidence)
        return SMCResult(
            log_evidence=log_evidence,
            log_weights=log_weights,
            particles=particles,
            ess=ess_all,
            ancestors=ancestors_all if resampling else identity.expand(num_steps, B, N),
            resampled=resampled_all,
        )

    def _resample(self, particles, log_weights, weights, resampled, ancestors_out, identity):
        """The new particles; the ancestors (identity in filters that do not resample) are
        written into ``ancestors_out``."""
        if self.relaxation is None:
            drawn = resample_indices(weights, self.resample, self.generator)
            ancestors = torch.where(resampled[:, None], drawn, identity, out=ancestors_out)
            return _gather(particles, ancestors)  # the identity rows gather themselves
        B, N = weights.shape
        uniform = torch.rand(B, N, N, device=weights.device, dtype=log_weights.dtype, generator=self.generator)
        gumbel = -(-uniform.clamp(min=1e-20).log()).log()
        scores = log_weights[:, None, :] + gumbel  # row i: the choice of new particle i
        soft = (scores / self.temperature).softmax(-1)
        hard_choice = scores.argmax(-1)
        if self.relaxation == "straight-through":
            hard = torch.nn.functional.one_hot(hard_choice, N).to(soft.dtype)
            mixing = hard + soft - soft.detach()
        else:
            mixing = soft
        torch.where(resampled[:, None], hard_choice, identity, out=ancestors_out)
        return _select(resampled, _mix(particles, mixing), particles)

    # ---- Pyro state-space models ------------------------------------------------------

    def _filter_pyro(self, model, data, batch_size, num_steps, init_args) -> SMCResult:
        """Run a Pyro model object (``init(state, *init_args)``, ``step(state[, y])``; latent
        sites drawn from their prior: the bootstrap proposal)."""
        if data is None:
            if num_steps is None or batch_size is None:
                raise ValueError("without data, give num_steps and batch_size")
            _check_count("num_steps", num_steps, 0, MAX_STEPS)
            B, T, event_shape = batch_size, num_steps, ()
        else:
            if not isinstance(data, torch.Tensor) or data.dim() < 1:
                raise ValueError("data must be a tensor of observations [T, ...] or [B, T, ...]")
            if batch_size is None:
                data = data[None]
            elif data.shape[0] == 1 and batch_size > 1:  # one sequence [1, T, ...]: broadcast to every filter
                data = data.expand(batch_size, *data.shape[1:])
            elif data.shape[0] != batch_size:
                raise ValueError(
                    f"data must have shape [batch_size={batch_size}, T, ...] or [1, T, ...] (broadcast), "
                    f"got {tuple(data.shape)}"
                )
            B, T = data.shape[:2]
            event_shape = data.shape[2:]
        self._check_batch(B)
        N = self.num_particles
        reference = data if data is not None else next((a for a in init_args if isinstance(a, torch.Tensor)), None)
        dtype = reference.dtype if reference is not None else torch.get_default_dtype()
        device = reference.device if reference is not None else None

        def flatten(state):
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"model state[{key!r}] must be a tensor, got {type(value).__name__}")
            return {k: v.reshape(B, N, *v.shape[1:]) for k, v in state.items()}

        def unflatten(particles):
            return {k: v.reshape(B * N, *v.shape[2:]) for k, v in particles.items()}

        def run(fn, state, *args):
            with poutine.trace() as tracer, pyro.plate("particles", B * N, dim=-1):
                fn(state, *args)
            trace = tracer.trace
            trace.compute_log_prob()
            increment = torch.zeros(B * N, dtype=dtype, device=device)
            for site in trace.nodes.values():
                if site["type"] == "sample" and site["is_observed"]:
                    increment = increment + site["log_prob"].reshape(B * N, -1).sum(-1)
            return increment.reshape(B, N)

        def init(_):
            state = {}
            run(model.init, state, *init_args)
            return flatten(state)

        def step(t, particles):
            state = unflatten(particles)
            if data is None:
                increment = run(model.step, state)
            else:
                y = data[:, t].repeat_interleave(N, 0).reshape(B * N, *event_shape)
                increment = run(model.step, state, y)
            return flatten(state), increment  # after the step has written the new state

        return self._run(init, step, T, B)
