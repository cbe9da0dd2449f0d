"""Gibbs sampling of a CRF with NumPyro: the reference for graphs too big to enumerate.

The CRF's log-potential is restated in JAX (NumPyro cannot run a Pyro model) from
the *tables* the CRF exposes as data (``unary_table``, ``ternary_tensor``,
``distance_groups``, ``arc_mask``), so the structure is read, not re-declared.

Blocked (collapsed) Gibbs: given the labels z, every head H_i^c and global G_i is
independent, so they are summed out in closed form and
``numpyro.infer.DiscreteGibbs`` runs on z alone (exact single-site conditionals,
random-scan sweeps, chains side by side under ``jax.vmap``). Then (h, g) | z is
drawn exactly as one block per draw, and the h and g marginals are
Rao-Blackwellised (averages of the exact conditionals). Plain single-site Gibbs
over (z, h) gets stuck when labels and heads are strongly coupled.

Extra templates (``CRF(factors=[...])``) add to the potential of z: a ``Pairwise`` is
restated in JAX from its table and arcs; a user ``graphs.Factor`` needs only its
``log_potential`` of full labellings, called in torch from JAX (``jax.pure_callback``,
float64, no gradient). ``Gibbs(crf)`` refuses, when it is built, a site of an overridden
``CRF.model`` that no template made (``inference.declaration``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from inference import arviz_interop
from inference.declaration import compile_templates
from inference.posterior import Posterior

__all__ = ["Gibbs", "GibbsResult"]

# Limits: JAX allocates every draw up front, so absurd counts are refused
# before it tries (num_samples=10**12 asked for 8 TB).
MAX_DRAWS = 10**7  # num_samples and num_warmup, each, per chain
MAX_CHAINS = 2**10
MAX_SEED = 2**32 - 1  # jax.random.PRNGKey's seed range
MAX_DRAWN_VALUES = 2**30  # chains x samples x the per-draw values of one sentence batch: 8 GiB of float64


@dataclass
class GibbsResult:
    """Draws and their summaries.

    marginals: ``Posterior`` of empirical marginals (z, h, g), in the CRF's dtype.
    standard_error: Monte-Carlo standard errors of those marginals (float64), same shapes:
        ``std / sqrt(ESS)`` of the per-draw values (z indicators; exact h and g
        conditionals), with ArviZ's bulk ESS.
    effective_sample_size: that ESS, same shapes (values that never move get the raw
        number of draws).
    rhat: the largest R-hat over every per-draw value that moves (1.0 = converged).
    inference_data: the draws as an ArviZ ``InferenceData`` (posterior z, h, g;
        h and g drawn exactly given each z).
    """

    marginals: Posterior
    standard_error: Posterior
    effective_sample_size: Posterior
    rhat: float
    inference_data: object


class Gibbs:
    """NumPyro Gibbs sampler for a ``graphs.CRF``: ``Gibbs(crf)(tokens, mask)`` gives the
    ``Posterior`` of the empirical marginals (the call every engine answers);
    ``sample(tokens, mask)`` gives them with their standard errors, R-hat and the draws.

    Args:
        crf: the CRF (every template compiled; see ``inference.declaration``).
        num_samples, num_warmup: draws kept and discarded per chain.
        num_chains: independent chains (vectorised).
        seed: the JAX PRNG seed.
    """

    def __init__(self, crf, num_samples: int = 2000, num_warmup: int = 500, num_chains: int = 4, seed: int = 0):
        for name, value, minimum, maximum in (
            ("num_samples", num_samples, 1, MAX_DRAWS),
            ("num_warmup", num_warmup, 0, MAX_DRAWS),
            ("num_chains", num_chains, 1, MAX_CHAINS),
            ("seed", seed, 0, MAX_SEED),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
                raise ValueError(f"{name} must be an integer >= {minimum} and <= {maximum} (the limit), got {value!r}")
        if not hasattr(crf, "templates"):
            raise TypeError(f"crf must be a graphs.CRF, got {type(crf).__name__}")
        crf.check_factor_graph()  # a product-key memory is no factor Gibbs could sample
        self.crf = crf
        self.templates = compile_templates(crf, "Gibbs")
        self.num_samples, self.num_warmup, self.num_chains, self.seed = (
            num_samples,
            num_warmup,
            num_chains,
            seed,
        )

    def _check_draw_size(self, values_per_draw: int) -> None:
        """Every draw keeps its z indicators, head conditionals and global conditionals
        (``values_per_draw``), for every chain and sample: refuse a total above the limit."""
        total = self.num_chains * self.num_samples * values_per_draw
        if total > MAX_DRAWN_VALUES:
            raise ValueError(
                f"num_chains x num_samples x values per draw = {self.num_chains} x {self.num_samples} x "
                f"{values_per_draw} exceeds the limit {MAX_DRAWN_VALUES} (2**30) stored values: "
                f"reduce num_samples or num_chains, or sample fewer or shorter sentences"
            )

    def __call__(self, tokens=None, mask=None, embeddings=None) -> Posterior:
        """The empirical marginals z, h, g (``sample(...).marginals``)."""
        return self.sample(tokens, mask, embeddings).marginals

    def sample(self, tokens=None, mask=None, embeddings=None) -> GibbsResult:
        """Draws for token ids ``tokens [B, n]``, or ``embeddings [B, n, D]`` for a CRF with
        ``embedding_size``: the labels by collapsed Gibbs, then the heads and globals given
        each draw of the labels, then their summaries."""
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        crf = self.crf
        tokens, mask = crf.check_any(tokens, mask, embeddings)  # tokens: the checked ids or embeddings
        crf.check_parameters()
        B, n = mask.shape
        N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels
        self._check_draw_size(B * (N * d + C * N * N + n * G))
        import jax

        # float64 in JAX: without it every table becomes float32, and DiscreteGibbs's conditionals,
        # differences of the batch's summed potential, lost their precision at large potentials.
        # The thread-local switch, so other threads' JAX is untouched (a user factor's callback
        # returns its float64 as two float32: _extra_term).
        with jax.enable_x64(True):
            collapsed = _CollapsedCRF.of(crf, tokens, mask)
            z_draws, key_block = self._label_draws(collapsed)
            draws, values = _block_draws(collapsed, z_draws, key_block, crf.node_mask(mask).numpy())
        means, errors, sizes, rhat = _summaries(values, float(self.num_chains * self.num_samples))
        dims = {"z": ["sentence", "node"], "h": ["sentence", "channel", "node"], "g": ["sentence", "token"]}
        inference_data = arviz_interop.from_arrays({"posterior": draws}, dims=dims)
        dtype = crf.unary.dtype  # the Posterior contract: the CRF's dtype (the averages run in float64)
        marginal = {name: value.to(dtype) for name, value in means.items()}
        return GibbsResult(
            marginals=Posterior(z=marginal["z"], h=marginal["h"], g=marginal.get("g")),
            standard_error=Posterior(z=errors["z"], h=errors["h"], g=errors.get("g")),
            effective_sample_size=Posterior(z=sizes["z"], h=sizes["h"], g=sizes.get("g")),
            rhat=rhat,
            inference_data=inference_data,
        )

    def _label_draws(self, collapsed: _CollapsedCRF):
        """``(z_draws, key_block)``: the labels ``[chain, draw, B, N]`` drawn by NumPyro's
        ``DiscreteGibbs`` on the collapsed potential (chains side by side under ``jax.vmap``),
        and the PRNG key of the block draws that follow."""
        import jax
        import jax.numpy as jnp
        import numpyro
        import numpyro.distributions as dist
        from numpyro.infer import MCMC, DiscreteGibbs

        B, _, N, d, _, _ = collapsed.sizes

        def model():
            with numpyro.plate("sentence", B, dim=-2), numpyro.plate("node", N, dim=-1):
                z = numpyro.sample("z", dist.Categorical(logits=jnp.zeros((N, d))))
            numpyro.factor("potential", collapsed.log_potential(z))

        mcmc = MCMC(
            DiscreteGibbs(model),
            num_warmup=self.num_warmup,
            num_samples=self.num_samples,
            num_chains=self.num_chains,
            chain_method=jax.vmap,
            progress_bar=False,
        )
        key_chains, key_block = jax.random.split(jax.random.PRNGKey(self.seed))
        mcmc.run(key_chains)
        return mcmc.get_samples(group_by_chain=True)["z"], key_block


@dataclass(frozen=True)
class _CollapsedCRF:
    """One batch of sentences of the CRF restated in JAX (float64) from its tables: given the
    labels z ``[B, N]`` every head and global is independent, so they are summed out in closed
    form (``log_potential``) and drawn exactly as one block (``block``)."""

    sizes: tuple[int, int, int, int, int, int]  # B, n, N, d, C, G
    unary: object  # [B, N, d]
    table: object  # [K, C, d, d]
    binary: object  # the CRF's binary table of globals, or None without globals
    groups: object  # [N, N] distance group of each arc
    has_head: object  # [B, N]
    token_mask: object  # [B, n]
    illegal: object  # [B, 1, N(dependent), N(head)]
    channel: object  # [1, C, 1]
    extra_terms: tuple  # functions of z: the extra templates' log-potentials

    @classmethod
    def of(cls, crf, tokens, mask) -> _CollapsedCRF:
        import jax.numpy as jnp

        B, n = mask.shape
        N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels
        with torch.no_grad():
            arcs_t = crf.arc_mask(mask)
            unary = jnp.asarray(crf.input_table(tokens, mask).double().cpu().numpy())
            table = jnp.asarray(crf.ternary_tensor().double().cpu().numpy())  # [K, C, d, d]
            binary = jnp.asarray(crf.binary.double().cpu().numpy()) if G else None
        arcs = jnp.asarray(arcs_t.cpu().numpy())
        has_head = arcs.any(-1)  # [B, N]
        groups = jnp.asarray(crf.distance_groups(n).numpy())
        token_mask = jnp.asarray(mask.cpu().numpy())
        channel = jnp.arange(C)[None, :, None]
        illegal = ~arcs[:, None, :, :]  # [B, 1, N(dependent), N(head)]
        nodes = crf.node_mask(mask)
        extra_terms = tuple(_extra_term(factor, tokens, mask, nodes, unary.dtype) for factor in crf.factors)
        sizes = (B, n, N, d, C, G)
        return cls(sizes, unary, table, binary, groups, has_head, token_mask, illegal, channel, extra_terms)

    def conditionals(self, z):
        """Log-conditionals of every head [B, C, N, N] and global [B, n, G] given z [B, N]."""
        import jax.numpy as jnp

        B, n, N, _, C, G = self.sizes
        z_dep = jnp.broadcast_to(z[:, None, :, None], (B, C, N, N))
        z_head = jnp.broadcast_to(z[:, None, None, :], (B, C, N, N))
        group = jnp.broadcast_to(self.groups[None, None], (B, C, N, N))
        head = self.table[group, self.channel[..., None], z_dep, z_head]
        head = jnp.where(self.illegal, -1e30, head)  # exp(-1e30) is exactly zero
        glob = self.binary.T[z[:, :n]] if G else None
        return head, glob

    def log_potential(self, z):
        """The log-potential of the labels z ``[B, N]``, heads and globals summed out, summed
        over the batch."""
        import jax
        import jax.numpy as jnp

        head, glob = self.conditionals(z)
        score = jnp.take_along_axis(self.unary, z[..., None], -1).sum()
        score += jnp.where(self.has_head[:, None, :], jax.nn.logsumexp(head, -1), 0.0).sum()
        if self.sizes[-1]:
            score += jnp.where(self.token_mask, jax.nn.logsumexp(glob, -1), 0.0).sum()
        for term in self.extra_terms:
            score += term(z)
        return score

    def block(self, key, z):
        """``(h, p(h | z), g, p(g | z))``: one exact draw of every head and global given z, and
        their conditionals (0 where a node has no head, or past the tokens)."""
        import jax
        import jax.numpy as jnp

        head, glob = self.conditionals(z)
        key_h, key_g = jax.random.split(key)
        h = jax.random.categorical(key_h, head)
        head_p = jnp.where(self.has_head[:, None, :, None], jax.nn.softmax(head, -1), 0.0)
        if not self.sizes[-1]:
            return h, head_p, None, None
        g = jax.random.categorical(key_g, glob)
        return h, head_p, g, jnp.where(self.token_mask[..., None], jax.nn.softmax(glob, -1), 0.0)


def _block_draws(collapsed: _CollapsedCRF, z_draws, key_block, node_mask: np.ndarray):
    """``(draws, values)``: the draws z, h (and g) ``[chain, draw, B, ...]``, the heads and
    globals drawn given each z; and the per-draw values whose means are the marginals (z
    indicators, the exact h and g conditionals)."""
    import jax

    B, n, N, d, C, G = collapsed.sizes
    flat = z_draws.reshape((-1, B, N))
    keys = jax.random.split(key_block, flat.shape[0])
    h, head_p, g, glob_p = jax.vmap(collapsed.block)(keys, flat)
    shape = z_draws.shape[:2]
    draws = {"z": np.asarray(z_draws), "h": np.asarray(h).reshape(shape + (B, C, N))}
    values = {
        "z": np.eye(d)[draws["z"]] * node_mask[..., None],
        "h": np.asarray(head_p).reshape(shape + (B, C, N, N)),
    }
    if G:
        draws["g"] = np.asarray(g).reshape(shape + (B, n))
        values["g"] = np.asarray(glob_p).reshape(shape + (B, n, G))
    return draws, values


def _summaries(values: dict, total: float):
    """``(means, errors, sizes, rhat)``: per value ``[chain, draw, ...]`` its mean, Monte-Carlo
    standard error ``std / sqrt(ESS)`` and bulk ESS (torch, float64; values that never move get
    ``total``, the raw number of draws), and the largest R-hat over the values that move (NaN
    with one chain)."""
    means, errors, sizes, rhats = {}, {}, {}, []
    for name, x in values.items():
        moving = x.std(axis=(0, 1)) > 1e-12
        with np.errstate(invalid="ignore", divide="ignore"):  # chains stuck on one value
            size = np.where(moving, arviz_interop.ess(x), total) if moving.any() else np.full(x.shape[2:], total)
            if moving.any() and x.shape[0] > 1:
                rhats.append(np.nanmax(np.where(moving, arviz_interop.rhat(x), np.nan)))
        means[name] = torch.from_numpy(x.mean(axis=(0, 1)))
        sizes[name] = torch.from_numpy(np.asarray(size, dtype=float))
        errors[name] = torch.from_numpy(x.std(axis=(0, 1)) / np.sqrt(size))
    return means, errors, sizes, float(max(rhats)) if rhats else float("nan")


def _extra_term(factor, tokens, mask, nodes, dtype):
    """A function of z ``[B, N]`` (JAX) -> the factor's total log-potential over the batch."""
    import jax
    import jax.numpy as jnp

    from graphs.factors import Pairwise

    n = tokens.shape[1]
    if isinstance(factor, Pairwise):
        with torch.no_grad():
            tables = jnp.asarray(factor.tables(n).double().cpu().numpy())  # [n, n, d, d]
            arcs = jnp.asarray(factor.arcs(mask).cpu().numpy())  # [B, n, n]
        row, col = jnp.arange(n)[:, None], jnp.arange(n)[None, :]

        def pairwise(z):
            z = z[:, :n]
            score = tables[row, col, z[:, :, None], z[:, None, :]]  # [B, n, n]
            return jnp.where(arcs, score, 0.0).sum()

        return pairwise

    keep = nodes.cpu().numpy()

    def in_torch(z):
        """``z [..., B, N]`` (any leading vmap dims) -> ``[...]`` summed over the batch."""
        z = torch.from_numpy(np.where(keep, np.asarray(z), 0)).long()
        lead = z.shape[:-2]
        flat = z.reshape(-1, z.shape[-1])
        repeat = flat.shape[0] // tokens.shape[0]
        inputs = tokens.repeat(repeat, *[1] * (tokens.dim() - 1))  # token ids [B', n] or embeddings [B', n, D]
        with torch.no_grad():
            value = factor.log_potential(flat, inputs, mask.repeat(repeat, 1))
        total = value.double().reshape(*lead, -1).sum(-1).numpy()
        parts = _as_two_float32(total)
        if (np.isfinite(total) & ~np.isfinite(parts[..., 0])).any():
            raise ValueError(f"{type(factor).__name__}.log_potential: a batch total beyond float32's range")
        return parts

    def user(z):
        # XLA runs the callback on its own threads, where the thread-local float64 switch is
        # off and JAX would read a float64 result as float32: the total comes back as two
        # float32 (high + low, exact to 2**-48 of it) and is summed again in float64 here.
        parts = jax.pure_callback(in_torch, jax.ShapeDtypeStruct((2,), np.float32), z, vmap_method="broadcast_all")
        return parts[..., 0].astype(dtype) + parts[..., 1].astype(dtype)

    return user


def _as_two_float32(total: np.ndarray) -> np.ndarray:
    """float64 ``total`` [...] as float32 ``[..., 2]``, high and low, whose float64 sum is
    ``total`` to 2**-48 of it; an infinite total (a zero potential: -inf) is (total, 0), not
    (inf, inf - inf = NaN)."""
    high = total.astype(np.float32)
    low = np.subtract(total, high, out=np.zeros_like(total), where=np.isfinite(high))
    return np.stack([high, low.astype(np.float32)], axis=-1)
