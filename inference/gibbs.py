"""Gibbs sampling of a CRF with NumPyro: the reference for graphs too big to enumerate.

The CRF's log-potential is restated in JAX (NumPyro cannot run a Pyro model) from
the *tables* the CRF exposes as data (``unary_table``, ``ternary_tensor``,
``distance_groups``, ``arc_mask``), so the structure is read, not re-declared.
Sampling uses ``numpyro.infer.DiscreteGibbs`` (exact single-site conditionals in a
random-scan sweep); chains run side by side under ``jax.vmap``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from inference import arviz_interop
from inference.posterior import Posterior

__all__ = ["Gibbs", "GibbsResult"]


@dataclass
class GibbsResult:
    """Draws and their summaries.

    marginals: ``Posterior`` of empirical marginals (z, h, g).
    standard_error: Monte-Carlo standard errors of those marginals, same shapes,
        ``sqrt(p (1 - p) / ESS)`` with ArviZ's bulk ESS of each indicator.
    effective_sample_size: ArviZ bulk ESS of each indicator, same shapes (indicators
        that never move get the raw number of draws).
    rhat: the largest R-hat over every indicator that moves (1.0 = converged).
    inference_data: the draws as an ArviZ ``InferenceData`` (posterior z, h, g).
    """

    marginals: Posterior
    standard_error: Posterior
    effective_sample_size: Posterior
    rhat: float
    inference_data: object


class Gibbs:
    """NumPyro Gibbs sampler for a ``graphs.CRF``.

    Args:
        crf: the CRF.
        num_samples, num_warmup: draws kept and discarded per chain.
        num_chains: independent chains (vectorised).
        seed: the JAX PRNG seed.
    """

    def __init__(self, crf, num_samples: int = 2000, num_warmup: int = 500, num_chains: int = 4, seed: int = 0):
        for name, value, minimum in (
            ("num_samples", num_samples, 1),
            ("num_warmup", num_warmup, 0),
            ("num_chains", num_chains, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        self.crf = crf
        self.num_samples, self.num_warmup, self.num_chains, self.seed = num_samples, num_warmup, num_chains, seed

    def sample(self, tokens, mask=None) -> GibbsResult:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax
        import jax.numpy as jnp
        import numpyro
        import numpyro.distributions as dist
        from numpyro.infer import MCMC, DiscreteGibbs

        crf = self.crf
        tokens, mask = crf.check_inputs(tokens, mask)
        crf.check_parameters()
        B, n = tokens.shape
        N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels
        with torch.no_grad():
            arcs_t = crf.arc_mask(mask)
            unary = jnp.asarray(crf.unary_table(tokens, mask).double().cpu().numpy())
            table = jnp.asarray(crf.ternary_tensor().double().cpu().numpy())  # [K, C, d, d]
            binary = jnp.asarray(crf.binary.double().cpu().numpy()) if G else None
        arcs = jnp.asarray(arcs_t.cpu().numpy())
        has_head = arcs.any(-1)  # [B, N]
        groups = jnp.asarray(crf.distance_groups(n).numpy())
        token_mask = jnp.asarray(mask.cpu().numpy())
        # NumPyro rejects -inf logits; exp(-1e30) is exactly zero in floating point.
        head_logits = jnp.where(arcs | ~has_head[..., None], 0.0, -1e30)
        head_logits = jnp.broadcast_to(head_logits[:, None], (B, C, N, N))
        nodes = jnp.arange(N)[None, None, :]
        channel = jnp.arange(C)[None, :, None]

        def model():
            with numpyro.plate("sentence", B, dim=-3), numpyro.plate("node_z", N, dim=-1):
                z = numpyro.sample("z", dist.Categorical(logits=jnp.zeros((1, N, d))))[:, 0]  # [B, N]
            with numpyro.plate("sentence", B, dim=-3), numpyro.plate("channel", C, dim=-2):
                with numpyro.plate("node_h", N, dim=-1):
                    h = numpyro.sample("h", dist.Categorical(logits=head_logits))  # [B, C, N]
            score = jnp.take_along_axis(unary, z[..., None], -1).sum()
            z_dep = jnp.broadcast_to(z[:, None, :], (B, C, N))
            z_head = jnp.take_along_axis(z_dep, h, axis=-1)
            arc = table[groups[nodes, h], channel, z_dep, z_head]
            score = score + jnp.where(has_head[:, None, :], arc, 0.0).sum()
            if G:
                with numpyro.plate("sentence", B, dim=-3), numpyro.plate("token", n, dim=-1):
                    g = numpyro.sample("g", dist.Categorical(logits=jnp.zeros((1, n, G))))[:, 0]
                score = score + jnp.where(token_mask, binary[g, z[:, :n]], 0.0).sum()
            numpyro.factor("potential", score)

        mcmc = MCMC(
            DiscreteGibbs(model),
            num_warmup=self.num_warmup,
            num_samples=self.num_samples,
            num_chains=self.num_chains,
            chain_method=jax.vmap,
            progress_bar=False,
        )
        mcmc.run(jax.random.PRNGKey(self.seed))
        draws = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
        draws = {k: v[:, :, :, 0] if k in ("z", "g") else v for k, v in draws.items()}  # drop the channel axis

        nodes_np, has_head_np = crf.node_mask(mask).numpy(), np.asarray(has_head)
        indicators = {
            "z": np.eye(d)[draws["z"]] * nodes_np[..., None],
            "h": np.eye(N)[draws["h"]] * has_head_np[:, None, :, None],
        }
        if G:
            indicators["g"] = np.eye(G)[draws["g"]] * mask.numpy()[..., None]
        means, errors, sizes, rhats = {}, {}, {}, []
        total = float(self.num_chains * self.num_samples)
        for name, x in indicators.items():
            p = x.mean(axis=(0, 1))
            moving = x.std(axis=(0, 1)) > 0
            with np.errstate(invalid="ignore", divide="ignore"):  # chains stuck on one value
                size = np.where(moving, arviz_interop.ess(x), total) if moving.any() else np.full_like(p, total)
                if moving.any() and self.num_chains > 1:
                    rhats.append(np.nanmax(np.where(moving, arviz_interop.rhat(x), np.nan)))
            means[name] = torch.from_numpy(p)
            sizes[name] = torch.from_numpy(np.asarray(size, dtype=float))
            errors[name] = torch.from_numpy(np.sqrt(p * (1 - p) / size))
        inference_data = arviz_interop.from_arrays(
            {"posterior": draws},
            dims={"z": ["sentence", "node"], "h": ["sentence", "channel", "node"], "g": ["sentence", "token"]},
        )
        return GibbsResult(
            marginals=Posterior(z=means["z"], h=means["h"], g=means.get("g")),
            standard_error=Posterior(z=errors["z"], h=errors["h"], g=errors.get("g")),
            effective_sample_size=Posterior(z=sizes["z"], h=sizes["h"], g=sizes.get("g")),
            rhat=float(max(rhats)) if rhats else float("nan"),
            inference_data=inference_data,
        )
