"""The Particle Transformer: a transformer's forward pass read as Sequential Monte Carlo.

Layer l is time step l, the tokens of a sentence are its particles, attention scores
are importance weights, and the FFN is the move that rejuvenates particles.

- Weights: after each block, every token's log-weight grows by the log of the
  attention mass it receives (``log sum_i A_ij``, mean 1 over real tokens) and is
  carried into the next block as an additive attention bias (proper weighting).
- Resampling: after every K blocks, in each sentence whose ESS / n falls below
  ``ess_threshold`` (1.0: always), every position i draws an ancestor from its
  attention row and adds the ancestor's state to its residual stream: heavily
  attended tokens are duplicated, the rest fade; positions survive, so per-token
  heads (MLM) still work. The draw is Gumbel straight-through (hard forward, soft
  gradient) or Gumbel-softmax in training, argmax in eval (a fixed rule: exportable).
  Log-weights reset to 0 where resampling happened.
- Jitter: optional Gaussian noise of std ``jitter`` on the FFN move, in training.

``forward`` returns the task logits and a per-layer ``trace`` (log-weights, ESS,
resampled flags, token states, per-head attention) for the diagnostics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from probformer.models.blocks import (
    Block,
    TaskHead,
    check_token_inputs,
    log_attention_mass,
    normalised_ess,
    refuse_non_finite_weights,
)
from probformer.models.config import ConfigMixin

__all__ = ["ParticleConfig", "ParticleTransformer", "RESAMPLING"]

RESAMPLING = ("straight-through", "gumbel-softmax")


@dataclass
class ParticleConfig(ConfigMixin):
    vocab_size: int
    width: int = 256
    heads: int = 8
    layers: int = 4
    ffn_width: int = 1024
    max_length: int = 512
    dropout: float = 0.1
    resample_every: int = 2  # K
    ess_threshold: float = 0.5
    resampling: str = "straight-through"
    temperature: float = 1.0
    jitter: float = 0.0
    task: str = "mlm"
    num_classes: int = 0
    pooling: str = "mean"

    def __post_init__(self):
        self.check_integers(
            {
                "vocab_size": 1,
                "width": 1,
                "heads": 1,
                "layers": 1,
                "ffn_width": 1,
                "max_length": 1,
                "resample_every": 1,
                "num_classes": 0,
            }
        )
        if self.width % self.heads:
            raise ValueError(f"config key 'width' ({self.width}) must be divisible by 'heads' ({self.heads})")
        if not 0 <= self.ess_threshold <= 1:
            raise ValueError(f"config key 'ess_threshold' must lie in [0, 1], got {self.ess_threshold!r}")
        if self.resampling not in RESAMPLING:
            raise ValueError(f"config key 'resampling' must be one of {list(RESAMPLING)}, got {self.resampling!r}")
        if not self.temperature > 0 or self.jitter < 0 or not 0 <= self.dropout < 1:
            raise ValueError("config keys 'temperature' > 0, 'jitter' >= 0, 'dropout' in [0, 1) are required")
        self.check_task("Particle Transformer")


class ParticleTransformer(nn.Module):
    def __init__(self, config: ParticleConfig, generator: torch.Generator | None = None):
        super().__init__()
        refuse_non_finite_weights(self)  # NaN/inf weights are refused where they enter
        self.config, self.generator = config, generator
        self.embedding = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.max_length, config.width)
        self.blocks = nn.ModuleList(
            Block(config.width, config.heads, config.ffn_width, config.dropout) for _ in range(config.layers)
        )
        self.resample_norm = nn.LayerNorm(config.width)
        self.resample_value = nn.Linear(config.width, config.width)
        self.final_norm = nn.LayerNorm(config.width)
        outputs = config.vocab_size if config.task == "mlm" else config.num_classes
        self.head = TaskHead(config.task, config.width, outputs, config.pooling)

    def resample(self, x, attention, mask, active):
        """Each position draws an ancestor from its attention row; rows of sentences that
        are not ``active`` are left unchanged."""
        logits = attention.clamp(min=1e-30).log().masked_fill(~mask[:, None, :], -math.inf)
        if self.training:
            u = torch.rand(logits.shape, device=x.device, dtype=logits.dtype, generator=self.generator)
            scores = logits - (-u.clamp(min=1e-20).log()).log()  # + Gumbel noise
            soft = (scores / self.config.temperature).softmax(-1)
            if self.config.resampling == "straight-through":
                hard = F.one_hot(scores.argmax(-1), x.shape[1]).to(soft.dtype)
                choice = hard + soft - soft.detach()
            else:
                choice = soft
            moved = x + choice @ self.resample_value(self.resample_norm(x))
        else:  # a fixed rule at inference: the most attended ancestor, gathered (no one-hot of size n)
            ancestors = logits.argmax(-1)[..., None].expand(-1, -1, x.shape[-1])
            moved = x + self.resample_value(self.resample_norm(x)).gather(1, ancestors)
        return torch.where(active[:, None, None], moved, x)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        tokens, mask = check_token_inputs(tokens, mask, self.config.vocab_size, self.config.max_length)
        B, n = tokens.shape
        x = self.embedding(tokens) + self.position(torch.arange(n, device=tokens.device))
        padding = torch.where(mask, 0.0, -math.inf).to(x.dtype)
        log_weights = torch.zeros(B, n, device=x.device, dtype=x.dtype).masked_fill(~mask, -math.inf)
        trace = {"log_weights": [], "ess": [], "resampled": [], "hidden": [], "attention": []}
        for index, block in enumerate(self.blocks):
            bias = padding + log_weights.masked_fill(~mask, 0.0)  # proper weighting
            mixed, per_head = block.attend(x, bias, return_attention=True)
            attention = per_head.mean(1)
            x = x + F.dropout(mixed, self.config.dropout, self.training)
            move = block.transition(x)
            if self.training and self.config.jitter:
                move = move + self.config.jitter * torch.randn(
                    move.shape, device=x.device, dtype=x.dtype, generator=self.generator
                )
            x = x + move
            log_weights = log_weights + log_attention_mass(attention, mask)
            log_weights = log_weights - log_weights.logsumexp(-1, keepdim=True) + mask.sum(-1, keepdim=True).log()
            ess = normalised_ess(log_weights, mask)
            resampled = torch.zeros(B, dtype=torch.bool, device=x.device)
            if (index + 1) % self.config.resample_every == 0:
                always = self.config.ess_threshold >= 1
                resampled = torch.ones_like(resampled) if always else ess < self.config.ess_threshold
                x = self.resample(x, attention, mask, resampled)
                log_weights = torch.where(resampled[:, None] & mask, 0.0, log_weights)
            trace["log_weights"].append(log_weights)
            trace["ess"].append(ess)
            trace["resampled"].append(resampled)
            trace["hidden"].append(x)
            trace["attention"].append(per_head)
        logits = self.head(self.final_norm(x), mask)
        return logits, {k: torch.stack(v) for k, v in trace.items()}

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): per layer the
        token states ``hidden [L, B, n, D]``, attention ``[L, B, H, n, n]`` and the
        importance log-weights ``[L, B, n]``."""
        _, trace = self(tokens, mask)
        return {"hidden": trace["hidden"], "attention": trace["attention"], "log_weights": trace["log_weights"]}
