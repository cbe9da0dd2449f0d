"""The transformer as Sequential Monte Carlo, declared as a Pyro model.

Tokens are particles; one step is one (weight-tied) layer:

    attention  A = softmax(q k^T / sqrt(r)) among the tokens of a sentence
    move       x_t ~ Normal(x + A v + FFN(x + A v), sigma)    (Delta when sigma = 0)
    weight     pyro.factor: log of the attention mass each token receives, sum_i A_ij
               (``weight="mass"``) or of the token's own row maximum (``weight="row"``)

It is a model *object* with ``init(state, embeddings)`` / ``step(state)``, the
interface of ``pyro.infer.SMCFilter`` (which also needs ``bootstrap_guide()``), so
the same declaration runs under SMCFilter (one sentence at a time) and under
``inference.SMC`` (sentences batched).
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from torch import nn

from graphs.device_checks import refuse_non_finite
from graphs.limits import LIMITS, MAX_EMBEDDING_SIZE, check_size

__all__ = ["ParticleView"]

WEIGHTS = ("mass", "row")


class ParticleView(nn.Module):
    def __init__(self, width: int, rank: int | None = None, sigma: float = 0.0, weight: str = "mass"):
        super().__init__()
        # the sizes as the CRF's (graphs.limits): TypeError for a non-integer, ValueError out of range
        check_size("width", width, minimum=1, maximum=MAX_EMBEDDING_SIZE)
        rank = width if rank is None else rank  # only None means "as wide": rank=0 is an error
        check_size("rank", rank, minimum=1, maximum=max(LIMITS["rank"], width))
        if isinstance(sigma, bool) or not isinstance(sigma, int | float):
            raise TypeError(f"sigma must be a finite number >= 0 (0: deterministic moves), got {sigma!r}")
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0 (0: deterministic moves), got {sigma!r}")
        if weight not in WEIGHTS:
            raise ValueError(f"unknown weight {weight!r}; allowed: {list(WEIGHTS)}")
        sigma = float(sigma)
        self.sigma, self.weight, self.num_tokens = sigma, weight, None
        self.query, self.key = nn.Linear(width, rank, bias=False), nn.Linear(width, rank, bias=False)
        self.value = nn.Linear(width, width, bias=False)
        self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))

    def move(self, x: torch.Tensor):
        """Transition mean ``[P, D]`` and log incremental weights ``[P]`` for particles
        ``x [P, D]`` (P = sentences x tokens, sentences contiguous)."""
        n = self.num_tokens
        h = x.reshape(-1, n, x.shape[-1])
        scores = self.query(h) @ self.key(h).transpose(-1, -2) / math.sqrt(self.query.out_features)
        attention = scores.softmax(-1)
        mixed = h + attention @ self.value(h)
        mean = mixed + self.ffn(mixed)
        if self.weight == "mass":
            log_weight = attention.sum(-2).log()
        else:
            log_weight = attention.amax(-1).log() + math.log(n)
        return mean.reshape(x.shape), log_weight.reshape(-1)

    def _transition(self, mean):
        if self.sigma == 0:
            return dist.Delta(mean, event_dim=1)
        return dist.Normal(mean, self.sigma).to_event(1)

    def check_embeddings(self, embeddings) -> torch.Tensor:
        """``embeddings`` as ``init`` takes them: a floating tensor ``[n, D]`` or ``[B, n, D]``
        with D = width, non-empty and finite (no host read unless it is not)."""
        width = self.value.in_features
        if not isinstance(embeddings, torch.Tensor) or not embeddings.dtype.is_floating_point:
            found = embeddings.dtype if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
            raise TypeError(f"embeddings must be a floating torch.Tensor [n, {width}] or [B, n, {width}], got {found}")
        if embeddings.dim() not in (2, 3) or embeddings.shape[-1] != width or 0 in embeddings.shape:
            raise ValueError(
                f"embeddings must have shape [n, {width}] or [B, n, {width}] (width), non-empty, "
                f"got {tuple(embeddings.shape)}"
            )
        refuse_non_finite("embeddings", embeddings)
        return embeddings

    def init(self, state, embeddings: torch.Tensor):
        """``embeddings``: ``[n, D]`` (one sentence) or ``[B, n, D]``."""
        embeddings = self.check_embeddings(embeddings)
        self.num_tokens = embeddings.shape[-2]
        state["x"] = pyro.sample("x_init", dist.Delta(embeddings.reshape(-1, embeddings.shape[-1]), event_dim=1))

    def step(self, state):
        mean, log_weight = self.move(state["x"])
        state["x"] = pyro.sample("x", self._transition(mean))
        pyro.factor("attention_weight", log_weight)

    def bootstrap_guide(self):
        """A guide for ``pyro.infer.SMCFilter`` proposing from the transition itself."""
        view = self

        class Guide:
            def init(self, state, embeddings):
                embeddings = view.check_embeddings(embeddings)
                pyro.sample("x_init", dist.Delta(embeddings.reshape(-1, embeddings.shape[-1]), event_dim=1))

            def step(self, state):
                pyro.sample("x", view._transition(view.move(state["x"])[0]))

        return Guide()
