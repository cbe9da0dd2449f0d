"""Tempered (annealed) SMC from a proposal q to a CRF's posterior p: log Z, its standard
error and posterior marginals of any CRF the Gibbs engine compiles.

The particles of every sentence start as exact draws from q (by default the mean-field
posterior of the same CRF) and move along p_beta ∝ q^(1 - beta) gamma^beta, beta from 0 to 1
(``inference.smc.tempered.target``: gamma is the CRF's unnormalised joint of labels, heads and
globals). Each step

1. picks the next beta per particle system by bisection on the conditional ESS (Zhou,
   Johansen and Aston 2016): the largest increment delta with
   ``(sum_i W_i w_i)^2 / sum_i W_i w_i^2 >= target_ess``, ``w_i = exp(delta log(gamma/q)(x_i))``,
   ``W`` the normalised weights; vectorised over systems, on the device;
2. reweights: ``log Z += log sum_i W_i w_i`` (q is normalised, so Z_0 = 1);
3. resamples the systems whose ESS fell below ``resample_threshold`` (``inference.smc.resamplers``);
4. moves every particle with ``sweeps`` batched Gibbs sweeps at the new beta
   (``inference.smc.tempered.gibbs_moves``), which leave p_beta invariant.

The particle systems and the parts of a step: ``inference.smc.tempered.tempering``.

Along a fixed schedule Z-hat of one system is unbiased for Z; a schedule each system picks
from its own particles biases it low by O(1/P). So by default a pilot run (one adaptive
system per sentence) picks each sentence's schedule, and ``replicates`` independent systems
per sentence then follow it, side by side in one batch: the estimate is ``log mean_r Z-hat_r`` and its standard error
the delta-method ``sd_r(Z-hat_r / mean) / sqrt(R)``. The loop reads the device once every
``check_every`` steps (have all systems reached beta = 1?), never within a step.

The marginals are Rao-Blackwellised weighted particle averages at beta = 1: each label's
exact conditional given the rest, each head's and global's given the labels.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from inference.posterior import Posterior
from inference.smc.resamplers import RESAMPLERS
from inference.smc.tempered import collapsed_weights, gibbs_moves
from inference.smc.tempered.target import TemperedTarget, compile_target
from inference.smc.tempered.tempering import Systems

__all__ = ["TemperedSMC", "TemperedSMCResult"]

BISECTION_STEPS = 50  # resolution 2**-50 of the remaining temperature range


@dataclass
class TemperedSMCResult:
    """What a run gives (R replicates, B sentences, P particles, T tempering steps).

    posterior: ``Posterior`` of the marginals z, h (computed on first access), g, with
        ``log_partition`` the estimate of log Z.
    log_partition: ``[B]`` float64, ``log mean_r Z-hat_r``.
    standard_error: ``[B]`` its standard error (delta method over replicates; NaN for R = 1).
    replicate_log_partition: ``[R, B]`` log Z-hat of each independent system.
    betas: ``[T + 1, R, B]`` the schedule of each system (0 first, 1 last).
    ess: ``[T, R, B]`` the ESS (in particles) after each reweighting.
    log_weights: ``[R, B, P]`` the final normalised log importance weights.
    initial_log_ratio: ``[R, B, P]`` log gamma/q of the initial draws from q: the one-shot
        importance weights p/q (up to Z), e.g. for PSIS.
    steps: T.
    one_labelling: ``[B]`` bool, every draw from q was one labelling (q a point mass): nothing
        was weighed, the estimate is that labelling's, and its standard error is NaN (unknown).
    """

    posterior: Posterior
    log_partition: torch.Tensor
    standard_error: torch.Tensor
    replicate_log_partition: torch.Tensor
    betas: torch.Tensor
    ess: torch.Tensor
    log_weights: torch.Tensor
    initial_log_ratio: torch.Tensor
    steps: int
    one_labelling: torch.Tensor


def _integer(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return value


def _fraction(name: str, value, low: float, high: float, open_low: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (low < value if open_low else low <= value) or not value <= high or math.isnan(value):
        raise ValueError(f"{name} must lie in {'(' if open_low else '['}{low}, {high}], got {value}")
    return float(value)


class TemperedSMC:
    """Tempered SMC for a ``graphs.CRF``: ``TemperedSMC(crf)(tokens, mask)`` gives the
    ``Posterior`` (the call every engine answers); ``run(tokens, mask)`` the whole result.

    Args:
        crf: a ``graphs.CRF`` whose templates Gibbs compiles (built-ins, ``Pairwise``, user
            factors with ``log_potential``).
        num_particles: P per system; replicates: R independent systems per sentence.
        proposal: an engine called as ``proposal(tokens, mask)`` (or ``embeddings=``) that
            returns a ``Posterior`` of this CRF; default ``MeanField(crf, iterations=4)``.
            ``run(..., proposal=posterior)`` takes a ``Posterior`` directly.
        target_ess: the conditional-ESS fraction each tempering step keeps, in (0, 1).
        resample: one of ``inference.smc.resamplers.RESAMPLERS``; resample_threshold: resample a
            system when its ESS / P falls below it ((0, 1]; 1: every step).
        sweeps: Gibbs sweeps per step; rounds: label rounds per sweep (the colouring's).
        max_steps: tempering steps at most (the last one goes to beta = 1 whatever its ESS).
        check_every: steps between the device reads that end the loop early.
        proposal_floor: epsilon of the uniform distribution mixed into every row of q.
        seed: seed of the run's own generator (None: torch's global generator).
        pilot: pick the schedule with a pilot run (one adaptive system per sentence), then
            run the R replicates along it: Z-hat is then exactly unbiased. False: each system
            adapts its own schedule (one run, but a schedule chosen from the particles biases
            Z-hat low by O(1/P)).
    """

    def __init__(
        self,
        crf,
        num_particles: int = 64,
        replicates: int = 4,
        proposal=None,
        target_ess: float = 0.8,
        resample: str = "systematic",
        resample_threshold: float = 0.5,
        sweeps: int = 1,
        rounds: int = 8,
        max_steps: int = 256,
        check_every: int = 8,
        proposal_floor: float = 1e-6,
        seed: int | None = None,
        pilot: bool = True,
    ):
        if not hasattr(crf, "templates"):
            raise TypeError(f"crf must be a graphs.CRF, got {type(crf).__name__}")
        _check_compilable(crf)
        self.crf = crf
        self.num_particles = _integer("num_particles", num_particles, 1, 2**20)
        self.replicates = _integer("replicates", replicates, 1, 2**16)
        self.target_ess = _fraction("target_ess", target_ess, 0.0, 1.0)
        if self.target_ess >= 1.0:
            raise ValueError(f"target_ess must lie in (0, 1), got {target_ess}")
        if resample not in RESAMPLERS:
            raise ValueError(f"resample must be one of {list(RESAMPLERS)}, got {resample!r}")
        self.resample = resample
        self.resample_threshold = _fraction("resample_threshold", resample_threshold, 0.0, 1.0)
        self.sweeps = _integer("sweeps", sweeps, 1, 10_000)
        self.rounds = _integer("rounds", rounds, 1, 10_000)
        self.max_steps = _integer("max_steps", max_steps, 1, 100_000)
        self.check_every = _integer("check_every", check_every, 1, 100_000)
        self.proposal_floor = _fraction("proposal_floor", proposal_floor, 0.0, 0.5, open_low=False)
        self.seed = None if seed is None else _integer("seed", seed, 0, 2**63 - 1)
        if proposal is not None and not callable(proposal):
            raise TypeError(
                f"proposal must be an engine (callable returning a Posterior), got {type(proposal).__name__}"
            )
        self.proposal = proposal
        if not isinstance(pilot, bool):
            raise TypeError(f"pilot must be True or False, got {type(pilot).__name__}")
        self.pilot = pilot

    def __call__(self, tokens=None, mask=None, embeddings=None, proposal=None) -> Posterior:
        return self.run(tokens, mask, embeddings, proposal).posterior

    def run(self, tokens=None, mask=None, embeddings=None, proposal=None) -> TemperedSMCResult:
        """Tempered SMC on token ids ``tokens [B, n]`` (or ``embeddings [B, n, D]``) from
        ``proposal`` (a ``Posterior`` of this CRF on this batch; None: the engine's)."""
        crf = self.crf
        inputs, mask = crf.check_any(tokens, mask, embeddings)
        crf.check_parameters()
        if proposal is None:
            proposal = self._proposal_posterior(tokens, mask, embeddings)
        elif not isinstance(proposal, Posterior):
            raise TypeError(f"proposal must be an inference.Posterior, got {type(proposal).__name__}")
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=crf.unary.device).manual_seed(self.seed)
        with torch.no_grad():
            target = compile_target(crf, inputs, mask, proposal, self.proposal_floor, self.replicates)
            schedule = None
            if self.pilot:  # one adaptive system per sentence picks the schedule the replicates follow
                pilot = self._temper(dataclasses.replace(target, replicates=1), generator)
                finished = (pilot.betas[1:] >= 1).all(1)
                steps = int(finished.int().argmax()) + 1 if bool(finished.any()) else finished.shape[0]
                schedule = pilot.betas[1 : steps + 1].repeat(1, self.replicates)  # [T, S]
            run = self._temper(target, generator, schedule)
            posterior_parts = self._marginals(target, run.z, run.h, run.g, run.log_w)
            return self._result(posterior_parts, run, (self.replicates, target.batch))

    def _proposal_posterior(self, tokens, mask, embeddings) -> Posterior:
        engine = self.proposal
        if engine is None:
            from inference.mean_field.engine import MeanField

            try:
                engine = MeanField(self.crf, iterations=4, kernel="naive")
            except ValueError as error:
                raise ValueError(
                    f"the default proposal, MeanField, cannot compile this CRF ({error}): pass proposal= "
                    f"(an engine, or a Posterior to run())"
                ) from None
        # a MeanField with confidence exit: its q at every iteration (no confidence to exit on)
        options = {"confidence": False} if getattr(engine, "halting", None) == "exit" else {}
        with torch.no_grad():
            if embeddings is None:
                posterior = engine(tokens, mask, **options)
            else:
                posterior = engine(mask=mask, embeddings=embeddings, **options)
        if not isinstance(posterior, Posterior):
            raise TypeError(f"the proposal engine must return an inference.Posterior, got {type(posterior).__name__}")
        return posterior

    def _temper(self, target: TemperedTarget, generator, schedule: torch.Tensor | None = None) -> _Run:
        """The tempering loop on every system of ``target``, weighing the labels alone
        (``collapsed_weights``): adaptive, or along ``schedule`` ``[T, S]`` (the beta of each
        system after each step; the head terms of a step's weights then come from one pass).
        Each step: the next beta, reweigh, resample, move (``inference.smc.tempered.tempering``)."""
        adaptive = schedule is None
        systems, initial_log_ratio = Systems.start(target, self.num_particles, generator, adaptive)
        one_labelling = (systems.z == systems.z[:, :1]).flatten(1).all(1)  # [S]: q drew one labelling only
        betas, esses = [systems.beta], []
        steps = self.max_steps if adaptive else schedule.shape[0]
        step = 0
        while step < steps:
            ess = systems.reweigh(target, self._next_beta(systems, schedule, step, steps), generator)
            betas.append(systems.beta)
            esses.append(ess)
            systems.resample(ess, self.resample_threshold * self.num_particles, self.resample, generator)
            systems.move(target, self.rounds, self.sweeps, generator)
            step += 1
            following = None if adaptive or step == steps else schedule[step]
            systems.rescore(target, adaptive, following, generator)
            if adaptive and step % self.check_every == 0 and bool((systems.beta >= 1).all()):  # the one device read
                break
        if not torch.isfinite(systems.log_z).all() or not torch.isfinite(systems.log_w).all():
            raise ValueError("non-finite importance weights during tempering: the potentials or the proposal overflow")
        stacked = torch.stack(betas), torch.stack(esses)
        run = (systems.z, systems.h, systems.g, systems.log_z, systems.log_w, initial_log_ratio, *stacked, step)
        return _Run(*run, one_labelling)

    def _next_beta(self, systems: Systems, schedule: torch.Tensor | None, step: int, steps: int) -> torch.Tensor:
        """``[S]``: the schedule's beta after ``step``, or (adaptive) the current beta plus the
        increment that keeps the conditional ESS at ``target_ess`` (1 on the last step)."""
        if schedule is not None:
            return schedule[step]
        remaining = 1.0 - systems.beta
        delta = self._increment(systems.log_w, systems.slope, remaining, last=step == steps - 1)
        return torch.where(delta >= remaining, 1.0, systems.beta + delta)

    def _increment(self, log_w, log_ratio, remaining, last: bool) -> torch.Tensor:
        """``[S]`` the largest delta in [0, remaining] that keeps the conditional ESS >=
        target_ess (all of ``remaining`` on the last step), by bisection on the device, with the
        increments to first order, ``delta log_ratio`` (``log_ratio``: d log p_beta / d beta)."""
        if last:
            return remaining

        def conditional_ess(delta):
            scaled = delta[:, None] * log_ratio
            return (2 * (log_w + scaled).logsumexp(-1) - (log_w + 2 * scaled).logsumexp(-1)).exp()

        low, high = torch.zeros_like(remaining), remaining
        for _ in range(BISECTION_STEPS):
            middle = (low + high) / 2
            keeps = conditional_ess(middle) >= self.target_ess
            low, high = torch.where(keeps, middle, low), torch.where(keeps, high, middle)
        return torch.where(conditional_ess(remaining) >= self.target_ess, remaining, low)

    def _marginals(self, target: TemperedTarget, z, h, g, log_w):
        """Per-system ``(z [S, N, d], h () -> [S, C, N, N], g [S, n, G] or None)``: weighted
        averages of the exact conditionals at beta = 1."""
        weights = log_w.exp()
        one = torch.ones(z.shape[0], dtype=weights.dtype, device=z.device)
        labels = gibbs_moves.label_logits(target, z, h, g, one).softmax(-1)
        nodes = target.per_system(target.nodes)[..., None]
        q_z = torch.einsum("sp,spnd->snd", weights.to(labels.dtype), labels) * nodes
        q_g = None
        if target.binary is not None:
            n = target.mask.shape[1]
            glob = target.binary.T[z[..., :n]].softmax(-1)
            q_g = torch.einsum("sp,spng->sng", weights.to(glob.dtype), glob) * target.per_system(target.mask)[..., None]

        def heads():
            return _head_marginals(target, z, weights)

        return q_z, heads, q_g

    def _result(self, parts, run: _Run, shape) -> TemperedSMCResult:
        R, B = shape
        q_z, heads, q_g = parts
        replicate_log_z = run.log_z.reshape(R, B)
        log_partition = replicate_log_z.logsumexp(0) - math.log(R)
        ratios = (replicate_log_z - log_partition).exp()
        standard_error = ratios.std(0) / math.sqrt(R) if R > 1 else torch.full_like(log_partition, math.nan)
        # q a point mass: every replicate weighed the same labelling, so the replicates agree
        # whatever mass of p lies elsewhere; a standard error of 0 would claim an exact answer
        one_labelling = run.one_labelling.reshape(R, B).all(0)
        standard_error = torch.where(one_labelling, math.nan, standard_error)
        if bool(one_labelling.any()):
            warnings.warn(
                f"TemperedSMC: every draw from the proposal was one labelling in sentence(s) "
                f"{one_labelling.nonzero().flatten().tolist()}: their log Z is that labelling's (p's mass "
                "elsewhere is unseen) and their standard error is NaN; use a broader proposal",
                stacklevel=3,
            )

        def over_replicates(x):  # in the CRF's dtype (the Posterior contract): the target may be wider
            return x.reshape(R, B, *x.shape[1:]).mean(0).to(self.crf.unary.dtype)

        posterior = Posterior(
            z=over_replicates(q_z),
            h=lambda: over_replicates(heads()),
            g=None if q_g is None else over_replicates(q_g),
            log_partition=log_partition,
        )
        P = run.log_w.shape[1]
        return TemperedSMCResult(
            posterior=posterior,
            log_partition=log_partition,
            standard_error=standard_error,
            replicate_log_partition=replicate_log_z,
            betas=run.betas.reshape(-1, R, B),
            ess=run.ess.reshape(-1, R, B),
            log_weights=run.log_w.reshape(R, B, P),
            initial_log_ratio=run.initial_log_ratio.reshape(R, B, P),
            steps=run.steps,
            one_labelling=one_labelling,
        )


@dataclass
class _Run:
    """The tempering loop's end state, per system ``[S, ...]``."""

    z: torch.Tensor
    h: torch.Tensor
    g: torch.Tensor | None
    log_z: torch.Tensor
    log_w: torch.Tensor
    initial_log_ratio: torch.Tensor
    betas: torch.Tensor  # [T + 1, S]
    ess: torch.Tensor  # [T, S]
    steps: int
    one_labelling: torch.Tensor  # [S]


def _check_compilable(crf) -> None:
    """Refuse, by name, a CRF whose factors the sampler cannot score (a user factor without
    log_potential among them: Gibbs refuses it too)."""
    from inference.declaration import compile_templates

    try:
        crf.check_factor_graph()
        compile_templates(crf, "Gibbs")
    except ValueError as error:
        raise ValueError(f"TemperedSMC cannot compile this CRF (it compiles what Gibbs does): {error}") from None


def _head_marginals(target: TemperedTarget, z, weights) -> torch.Tensor:
    """``[S, C, N, N]`` weighted average of p(H_i^c = j | z), a chunk of systems at a time."""
    S, P, N = z.shape
    K, C, d, _ = target.table.shape
    base = (target.groups[None] * C + torch.arange(C, device=z.device)[:, None, None]) * (d * d)
    arcs = target.per_system(target.arcs)
    has_head = target.per_system(target.has_head)
    flat = target.table.reshape(-1)
    step = max(1, collapsed_weights.CHUNK_ENTRIES // max(1, P * C * N * N))
    parts = []
    for start in range(0, S, step):
        part = slice(start, start + step)
        zs = z[part]
        logits = flat[base + (zs[:, :, None, :, None] * d + zs[:, :, None, None, :])]
        logits = logits.masked_fill(~arcs[part, None, None], float("-inf"))
        probs = torch.where(has_head[part, None, None, :, None], logits.softmax(-1), 0.0)
        parts.append(torch.einsum("sp,spcij->scij", weights[part].to(probs.dtype), probs))
    return torch.cat(parts)
