"""The tempered target of ``inference.TemperedSMC``: a ``graphs.CRF`` on one batch, compiled
into tensors, with the proposal q it starts from.

State of one particle: labels ``z [N]``, heads ``h [C, N]`` and globals ``g [n]``. For a
batch, particles are laid out ``[S, P, ...]``: S independent particle systems (replicates x
sentences, replicate-major: system s holds sentence s mod B) of P particles each.

    log gamma(z, h, g) = sum_i unary[i, z_i] + sum_{c, i has a head} T[k(i, h_i^c), c, z_i, z_{h_i^c}]
                         + sum_{real i} binary[g_i, z_i] + sum_extra log_potential(z)

the unnormalised log joint whose sum over every assignment is the partition function
``inference.Exact`` computes (``graphs.CRF.log_potential`` scores the same thing), and

    log q(z, h, g) = sum_i log q_z[i, z_i] + sum_{c, i} log q_h[c, i, h_i^c] + sum_i log q_g[i, g_i]

the proposal, a product of categoricals (any engine's ``Posterior``), each row restricted to
the values the CRF allows and mixed with a floor ``epsilon`` of the uniform distribution on
them, so q is positive wherever the CRF is and the importance weights stay finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["TemperedTarget", "compile_target", "sample_categorical"]


def sample_categorical(logits: torch.Tensor, generator=None) -> torch.Tensor:
    """One draw per row of ``logits [..., k]`` (rows that are all -inf give index 0): the
    inverse CDF, as a count of cumulative weights below a uniform fraction of the total."""
    shifted = logits - logits.amax(-1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)
    weights = shifted.exp().nan_to_num_(0.0)
    cumulative = weights.cumsum(-1)
    u = torch.rand(cumulative.shape[:-1] + (1,), device=logits.device, dtype=logits.dtype, generator=generator)
    # u < 1, so u * total < total: the count is at most k - 1, and it lands on a positive weight
    return (cumulative < u * cumulative[..., -1:]).sum(-1)


@dataclass
class TemperedTarget:
    """The batch's potentials and proposal, each per sentence ``[B, ...]``, and the
    particle layout (``replicates`` systems per sentence). Built by ``compile_target``."""

    inputs: torch.Tensor  # token ids [B, n] or embeddings [B, n, D]
    mask: torch.Tensor  # [B, n]
    nodes: torch.Tensor  # [B, N]
    arcs: torch.Tensor  # [B, N, N]
    has_head: torch.Tensor  # [B, N]
    unary: torch.Tensor  # [B, N, d]
    table: torch.Tensor  # [K, C, d, d]
    groups: torch.Tensor  # [N, N]
    binary: torch.Tensor | None  # [G, d]
    pairwise: list  # graphs.factors.Pairwise templates
    pairwise_adjacency: torch.Tensor | None  # [B, n, n] token pairs a Pairwise arc joins (either way)
    user: list  # other graphs.Factor templates (their log_potential only)
    log_qz: torch.Tensor  # [B, N, d]
    log_qh: torch.Tensor  # [B, C, N, N]
    log_qg: torch.Tensor | None  # [B, n, G]
    replicates: int
    cache: dict = field(default_factory=dict)  # tables the moves build once, per layout

    def cached(self, name: str, build):
        """``build()`` the first time ``name`` is asked for this layout, then the same tensor."""
        key = (name, self.replicates)
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    def per_system(self, x: torch.Tensor) -> torch.Tensor:
        """A per-sentence tensor ``[B, ...]`` repeated for every replicate: ``[S, ...]``."""
        if self.replicates == 1:
            return x
        return x.repeat(self.replicates, *([1] * (x.dim() - 1)))

    # ---- the two densities ------------------------------------------------------------

    def log_gamma(self, z: torch.Tensor, h: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """``[S, P]`` float64 unnormalised log joint of the particles."""
        nodes, has_head, mask = self.per_system(self.nodes), self.per_system(self.has_head), self.per_system(self.mask)
        unary = self.per_system(self.unary).double()
        S, P, N = z.shape
        score = unary[:, None].expand(S, P, N, -1).gather(-1, z[..., None]).squeeze(-1)
        score = torch.where(nodes[:, None], score, 0.0).sum(-1)
        arc = self.arc_scores(z, h).double()  # [S, P, C, N]
        score = score + torch.where(has_head[:, None, None], arc, 0.0).sum((-1, -2))
        if self.binary is not None:
            pair = self.binary.double()[g, z[..., : mask.shape[1]]]  # [S, P, n]
            score = score + torch.where(mask[:, None], pair, 0.0).sum(-1)
        for factor in [*self.pairwise, *self.user]:
            score = score + self.factor_log_potential(factor, z).double()
        return score

    def log_proposal(self, z: torch.Tensor, h: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """``[S, P]`` float64 log q of the particles."""
        nodes, has_head, mask = self.per_system(self.nodes), self.per_system(self.has_head), self.per_system(self.mask)
        S, P, N = z.shape
        C = h.shape[2]
        log_qz = self.per_system(self.log_qz)[:, None].expand(S, P, N, -1).gather(-1, z[..., None]).squeeze(-1)
        value = torch.where(nodes[:, None], log_qz, 0.0).double().sum(-1)
        rows = self.cached("log_qh", lambda: self.per_system(self.log_qh))
        log_qh = rows[:, None].expand(S, P, C, N, N).gather(-1, h[..., None]).squeeze(-1)
        value = value + torch.where(has_head[:, None, None], log_qh, 0.0).double().sum((-1, -2))
        if self.log_qg is not None:
            n, G = self.log_qg.shape[1:]
            log_qg = self.per_system(self.log_qg)[:, None].expand(S, P, n, G).gather(-1, g[..., None]).squeeze(-1)
            value = value + torch.where(mask[:, None], log_qg, 0.0).double().sum(-1)
        return value

    def sample_proposal(self, particles: int, generator=None, labels_only: bool = False):
        """``(z [S, P, N], h [S, P, C, N], g [S, P, n] or None)`` drawn from q (``labels_only``:
        z alone); padded nodes hold label 0 and rows without a legal head hold head 0 (neither
        is scored)."""

        def draw(log_q):
            rows = self.per_system(log_q)[:, None].expand(-1, particles, *log_q.shape[1:])
            return sample_categorical(rows, generator)

        nodes = self.per_system(self.nodes)[:, None]
        z = torch.where(nodes, draw(self.log_qz), 0)
        if labels_only:
            return z
        h = torch.where(self.per_system(self.has_head)[:, None, None], draw(self.log_qh), 0)
        g = None if self.log_qg is None else draw(self.log_qg)
        return z, h, g

    # ---- pieces the moves share ------------------------------------------------------

    def arc_scores(self, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``[S, P, C, N]`` T[k(i, h_i^c), c, z_i, z_{h_i^c}] of every (channel, node)."""
        K, C, d, _ = self.table.shape
        N = z.shape[-1]
        head_label = z[:, :, None, :].expand_as(h).gather(-1, h)
        group = self.groups[torch.arange(N, device=z.device), h]  # groups[i, h_i^c]
        channel = torch.arange(C, device=z.device)[:, None]
        index = ((group * C + channel) * d + z[:, :, None, :]) * d + head_label
        return self.table.reshape(-1)[index]

    def factor_log_potential(self, factor, z: torch.Tensor) -> torch.Tensor:
        """``[S, P]`` an extra template's log-potential of every particle's labels (padded
        nodes read as label 0, as in ``graphs.CRF.log_potential``)."""
        S, P, N = z.shape
        labels = torch.where(self.per_system(self.nodes)[:, None], z, 0).reshape(S * P, N)
        inputs, mask = self.per_particle(self.inputs, P), self.per_particle(self.mask, P)
        value = factor.log_potential(labels, inputs, mask)
        if not isinstance(value, torch.Tensor) or value.shape != (S * P,):
            raise ValueError(
                f"{factor.template}.log_potential must return a tensor of shape [B] = [{S * P}], "
                f"got {getattr(value, 'shape', type(value).__name__)}"
            )
        return value.reshape(S, P)

    def per_particle(self, x: torch.Tensor, particles: int) -> torch.Tensor:
        """A per-sentence tensor ``[B, ...]`` as one row per particle ``[S * P, ...]``."""
        rows = self.per_system(x)
        return rows[:, None].expand(rows.shape[0], particles, *rows.shape[1:]).reshape(-1, *rows.shape[1:])


def _log_rows(name: str, rows: torch.Tensor, support: torch.Tensor, epsilon: float) -> torch.Tensor:
    """log of ``rows`` restricted to ``support`` (bool, same shape), normalised and mixed
    with ``epsilon`` of the uniform distribution on the support; 0 off the support (unused)."""
    if not torch.isfinite(rows).all() or (rows < 0).any():
        raise ValueError(f"proposal.{name} must hold finite, non-negative probabilities")
    kept = torch.where(support, rows, 0.0).double()
    total = kept.sum(-1, keepdim=True)
    count = support.sum(-1, keepdim=True).clamp(min=1)
    has_mass = total > 0
    normalised = torch.where(has_mass, kept / total.clamp(min=1e-300), 1.0 / count)
    mixed = (1 - epsilon) * normalised + epsilon / count
    # a zero of q on the support becomes the smallest normal number: log q stays finite, so
    # (1 - beta) log q + beta log gamma is never inf - inf
    floor = math.log(torch.finfo(rows.dtype).tiny)
    return torch.where(support, mixed.log().clamp(min=floor), -math.inf).to(rows.dtype)


def compile_target(crf, inputs, mask, proposal, epsilon: float, replicates: int) -> TemperedTarget:
    """The target and proposal of one checked batch. ``proposal``: a ``Posterior`` of this
    CRF on this batch (its ``z [B, N, d]``, ``h [B, C, N, N]`` and ``g [B, n, G]``)."""
    from graphs.factors import Pairwise

    B, n = mask.shape
    N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels
    expected = {"z": (B, N, d), "h": (B, C, N, N), "g": (B, n, G) if G else None}
    found = {}
    for name, shape in expected.items():
        value = getattr(proposal, name, None)
        if shape is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"proposal.{name} must be a tensor of shape {list(shape)} for this batch, got {got}")
        found[name] = value.detach().to(crf.unary.device)
    with torch.no_grad():
        nodes, arcs = crf.node_mask(mask), crf.arc_mask(mask)
        has_head = arcs.any(-1)
        # at least float32: a half-precision table cannot hold FORBIDDEN, and its rounding
        # would enter every weight
        dtype = torch.promote_types(crf.unary.dtype, torch.float32)
        log_qz = _log_rows("z", found["z"].to(dtype), nodes[..., None].expand(B, N, d), epsilon)
        log_qh = _log_rows("h", found["h"].to(dtype), arcs[:, None].expand(B, C, N, N), epsilon)
        log_qg = None
        if G:
            log_qg = _log_rows("g", found["g"].to(dtype), mask[..., None].expand(B, n, G), epsilon)
        factors = list(crf.factors)
        pairwise = [f for f in factors if isinstance(f, Pairwise)]
        adjacency = None
        for factor in pairwise:
            arcs_of_factor = factor.arcs(mask)
            joined = arcs_of_factor | arcs_of_factor.transpose(1, 2)
            adjacency = joined if adjacency is None else adjacency | joined
        return TemperedTarget(
            inputs=inputs,
            mask=mask,
            nodes=nodes,
            arcs=arcs,
            has_head=has_head,
            unary=crf.input_table(inputs, mask).detach().to(dtype),
            table=crf.ternary_tensor(dtype).detach(),
            groups=crf.distance_groups(n, mask.device),
            binary=crf.binary.detach().to(dtype) if G else None,
            pairwise=pairwise,
            pairwise_adjacency=adjacency,
            user=[f for f in factors if not isinstance(f, Pairwise)],
            log_qz=log_qz,
            log_qh=log_qh,
            log_qg=log_qg,
            replicates=replicates,
        )
