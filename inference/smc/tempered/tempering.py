"""The particle systems of tempered SMC (``inference.smc.tempered.sampler``) and what one tempering step
does to them: reweigh to the next beta, resample, move (Gibbs sweeps at the new beta, which
leave p_beta invariant), then score the moved labels for the next step. Every system
``[S, P, ...]`` side by side; the weights read the labels alone (``collapsed_weights``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inference.smc.resamplers import resample_indices
from inference.smc.tempered import collapsed_weights, gibbs_moves
from inference.smc.tempered.target import TemperedTarget

__all__ = ["Systems"]


def _gather(x: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Particles ``[S, P, ...]`` at ``ancestors [S, P]``."""
    index = ancestors.reshape(*ancestors.shape, *([1] * (x.dim() - 2))).expand(*ancestors.shape, *x.shape[2:])
    return x.gather(1, index)


@dataclass
class Systems:
    """The state of S particle systems of P particles between tempering steps.

    ``z``: labels ``[S, P, N]``; ``h``, ``g``: heads and globals drawn given them (None before
    the first step; ``g`` None without globals). ``log_q``, ``potential``: the label terms of
    ``z`` (``collapsed_weights.label_terms``). ``log_current``: log p_beta of ``z`` at ``beta``
    (labels alone); ``slope``: its derivative in beta (adaptive schedules; else None).
    ``log_w``: normalised log-weights ``[S, P]``; ``log_z``: ``[S]`` log Z-hat so far; ``beta``:
    ``[S]``; ``pending``: the next beta's head and global terms and draws when known ahead
    (a fixed schedule), else None."""

    z: torch.Tensor
    h: torch.Tensor | None
    g: torch.Tensor | None
    log_q: torch.Tensor
    potential: torch.Tensor
    log_current: torch.Tensor
    slope: torch.Tensor | None
    log_w: torch.Tensor
    log_z: torch.Tensor
    beta: torch.Tensor
    pending: tuple | None = None

    @classmethod
    def start(cls, target: TemperedTarget, num_particles: int, generator, adaptive: bool):
        """``(systems, initial_log_ratio)``: P draws of the labels from the proposal per system at
        beta = 0 with uniform weights, and ``[S, P]`` log gamma/q of those draws."""
        P = num_particles
        z = target.sample_proposal(P, generator, labels_only=True)
        log_q, potential = collapsed_weights.label_terms(target, z)
        S = z.shape[0]
        beta, one = log_q.new_zeros(S), log_q.new_ones(S)
        derivative = 0 if adaptive else None
        heads, slope_h, _ = collapsed_weights.head_pass(target, z, [beta, one], derivative=derivative)
        glob, slope_g, _ = collapsed_weights.global_pass(target, z, [beta, one], derivative=derivative)
        log_current = log_q + heads[0] + glob[0]
        initial_log_ratio = potential + heads[1] + glob[1] - log_q  # log p(z) / q_z(z) up to log Z
        if not torch.isfinite(initial_log_ratio).all():
            raise ValueError("non-finite importance weights log(p/q) at the proposal's draws: check the proposal")
        slope = potential - log_q + slope_h + slope_g if adaptive else None
        log_w, log_z = log_q.new_full((S, P), -math.log(P)), log_q.new_zeros(S)
        systems = cls(z, None, None, log_q, potential, log_current, slope, log_w, log_z, beta)
        return systems, initial_log_ratio

    def reweigh(self, target: TemperedTarget, new_beta: torch.Tensor, generator) -> torch.Tensor:
        """Move every system to ``new_beta`` ``[S]``: ``log Z += log sum_i W_i w_i``, the weights
        renormalised, and the heads and globals drawn at ``new_beta``. Returns the ESS ``[S]``
        (in particles)."""
        if self.pending is None:  # the next beta's head terms and draws (a fixed schedule has them)
            self.pending = collapsed_weights.terms_at(target, self.z, new_beta, generator)
        heads_next, glob_next, self.h, self.g = self.pending
        log_next = torch.lerp(self.log_q, self.potential, new_beta[:, None]) + heads_next + glob_next
        weighted = self.log_w + (log_next - self.log_current)
        total = weighted.logsumexp(-1)
        self.log_z, self.log_w = self.log_z + total, weighted - total[:, None]
        self.beta = new_beta
        return torch.reciprocal((2 * self.log_w).exp().sum(-1))

    def resample(self, ess: torch.Tensor, threshold: float, method: str, generator) -> None:
        """Resample the systems whose ``ess`` fell below ``threshold`` (in particles) with
        ``method``; their weights become uniform. Ancestors are drawn for every system (the
        same draws whichever resample), the identity kept where none is due."""
        S, P = self.log_w.shape
        resampled = ess < threshold
        ancestors = resample_indices(self.log_w.exp(), method, generator)
        identity = torch.arange(P, device=self.z.device).expand(S, P)
        ancestors = torch.where(resampled[:, None], ancestors, identity)
        self.z, self.h = _gather(self.z, ancestors), _gather(self.h, ancestors)
        self.g = None if self.g is None else _gather(self.g, ancestors)
        self.log_w = torch.where(resampled[:, None], -math.log(P), self.log_w)

    def move(self, target: TemperedTarget, rounds: int, sweeps: int, generator) -> None:
        """``sweeps`` Gibbs sweeps of ``rounds`` label rounds at ``beta``: the first updates the
        labels given the heads and globals drawn with the weights, the others redraw all."""
        self.z = gibbs_moves.update_labels(target, self.z, self.h, self.g, self.beta, rounds, generator)
        for _ in range(sweeps - 1):
            self.z, self.h, self.g = gibbs_moves.sweep(target, self.z, self.h, self.g, self.beta, rounds, generator)

    def rescore(self, target: TemperedTarget, adaptive: bool, following: torch.Tensor | None, generator) -> None:
        """The label terms of the moved labels, and (adaptive, or a fixed schedule with a
        ``following`` beta) their log p_beta at this beta, with the slope or the following
        beta's terms and draws, in one pass."""
        self.log_q, self.potential = collapsed_weights.label_terms(target, self.z)
        if adaptive or following is not None:
            current, self.pending, slope = collapsed_weights.current_terms(
                target, self.z, self.beta, following, generator
            )
            self.slope = None if slope is None else self.potential - self.log_q + slope
            self.log_current = torch.lerp(self.log_q, self.potential, self.beta[:, None]) + current
