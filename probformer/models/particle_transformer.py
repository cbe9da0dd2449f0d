"""The Particle Transformer: a transformer's forward pass read as Sequential Monte Carlo.

Layer l is time step l, the tokens of a sentence are its particles, attention scores
are importance weights, and the FFN is the move that rejuvenates particles.

- Weights: after each block, every token's log-weight grows by the log of the
  attention mass it receives (``log sum_i A_ij``, mean 1 over real tokens) and is
  carried into the next block as an additive attention bias (proper weighting).
- Resampling, after every K blocks, in each sentence whose ESS / n falls below
  ``ess_threshold`` (1.0: always; the trigger is a device-side ``torch.where``, no host
  sync). Log-weights reset to 0 where resampling happened. Three kinds (``resampling``):

  ``"copy"`` (literal SMC resampling): each real token i takes its ancestor's vector,
  ``x_i <- x_a(i) + p_i``, with ancestors drawn among the real tokens of its sentence by
  ``resampler`` (multinomial, stratified, systematic: offspring counts with expectation
  n w_j); heavily weighted tokens are duplicated, the rest are killed. In eval the draw
  is systematic with u = 1/2 (a fixed rule: deterministic and exportable).
  *Position*: the copy carries its ancestor's position, and duplicates would be
  identical (same queries and keys from then on, so the same MLM prediction at every
  slot); so the position embedding p_i of slot i is added to the copy — each slot knows
  again where it is, and duplicates differ exactly by p_i - p_j.
  *Gradient* (no gradient passes a discrete draw): straight-through on the ancestor
  weight with a baseline, ``x_i = x_a + (l_a - sg(l_a)) (x_a - sg(xbar))`` with
  l = log w the normalised log-weights and xbar = sum_j w_j x_j. The added term is
  exactly 0 forward (the copy is exact); backward, d/dl_k gets
  ``g_i . (x_a - xbar) (1[a = k] - w_k)``: the score-function estimator of the
  gradient of E[x_a(i)] = xbar, with xbar as the baseline, applied to the loss's
  first-order expansion in x_i. Its expectation over the draw is w_k (x_k - xbar) . g_i,
  the gradient of the soft copy xbar; so the weights (hence attention) learn which
  tokens are worth duplicating, while the forward pass stays a hard copy.

  ``"mix"`` (the residual mixing this model had before; old configs' ``"straight-through"``
  and ``"gumbel-softmax"`` map to it with that ``relaxation``): every position draws a
  source from its attention row and *adds* ``W LN(x_source)`` to its residual stream; no
  token is duplicated or killed. Gumbel straight-through or Gumbel-softmax in training,
  argmax in eval.

  ``"none"``: never resample (the same network as ``ess_threshold = 0``, without the
  mixing layer's parameters).
- Jitter: optional Gaussian noise of std ``jitter`` on the FFN move, in training.

``forward`` returns the task logits and a per-layer ``trace`` (log-weights, ESS before
resampling, resampled flags, ancestors, token states, per-head attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphs.device_checks import refuse_non_finite_parameters
from probformer.models.blocks import (
    Block,
    TaskHead,
    check_token_inputs,
    log_attention_mass,
    normalised_ess,
    one_hot,
    refuse_non_finite_weights,
)
from probformer.models.config import ConfigMixin
from probformer.models.pretrained import PretrainedMixin

__all__ = ["ParticleConfig", "ParticleTransformer", "RESAMPLING", "RESAMPLERS", "RELAXATIONS", "draw_ancestors"]

RESAMPLING = ("copy", "mix", "none")
RESAMPLERS = ("systematic", "stratified", "multinomial")  # for "copy"
RELAXATIONS = ("straight-through", "gumbel-softmax")  # for "mix"
# before "mix" had its name, `resampling` held the mixing's relaxation: old configs still load
LEGACY_RESAMPLING = {relaxation: "mix" for relaxation in RELAXATIONS}


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
    resampling: str = "mix"  # the default of configs written before "copy" existed
    resampler: str = "systematic"
    relaxation: str = "straight-through"
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
        if self.resample_every > self.layers and self.resampling != "none":
            raise ValueError(
                f"config key 'resample_every' ({self.resample_every}) exceeds 'layers' ({self.layers}): the model "
                "would never resample; set resample_every <= layers, or resampling = 'none'"
            )
        if not 0 <= self.ess_threshold <= 1:
            raise ValueError(f"config key 'ess_threshold' must lie in [0, 1], got {self.ess_threshold!r}")
        if self.resampling in LEGACY_RESAMPLING:
            if self.relaxation not in (RELAXATIONS[0], self.resampling):
                raise ValueError(
                    f"config key 'resampling'={self.resampling!r} (the old name of resampling='mix' with that "
                    f"relaxation) contradicts 'relaxation'={self.relaxation!r}"
                )
            self.resampling, self.relaxation = LEGACY_RESAMPLING[self.resampling], self.resampling
        if self.resampling not in RESAMPLING:
            raise ValueError(f"config key 'resampling' must be one of {list(RESAMPLING)}, got {self.resampling!r}")
        if self.resampler not in RESAMPLERS:
            raise ValueError(f"config key 'resampler' must be one of {list(RESAMPLERS)}, got {self.resampler!r}")
        if self.relaxation not in RELAXATIONS:
            raise ValueError(f"config key 'relaxation' must be one of {list(RELAXATIONS)}, got {self.relaxation!r}")
        if not self.temperature > 0 or self.jitter < 0 or not 0 <= self.dropout < 1:
            raise ValueError("config keys 'temperature' > 0, 'jitter' >= 0, 'dropout' in [0, 1) are required")
        self.check_task("Particle Transformer")


def draw_ancestors(
    log_weights: torch.Tensor,
    mask: torch.Tensor,
    resampler: str = "systematic",
    generator: torch.Generator | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Ancestors ``[B, n]`` (long) for per-token log-weights ``[B, n]``: real slot i of row b
    gets a real token a(i) of row b, and token j gets n_b w_j offspring in expectation
    (n_b real tokens, w the normalised weights over them); padded slots point at
    themselves. ``deterministic``: systematic with u = 1/2, whatever ``resampler``.

    Inverse-CDF sampling at positions u_i (multinomial: i.i.d.; stratified: (r_i + u_i)/n_b;
    systematic: (r_i + u)/n_b, with r_i the rank of slot i among the real slots), all
    times the row's total weight C; a(i) is the first j with C_j >= position, counted as
    #{j : C_j < position}. The count is an [n, n] comparison (like attention) rather than
    a searchsorted, which torch's ONNX exporter lacks. Positions lie in (0, C], so the
    chosen token always has C_j > C_(j-1): a positive weight, never a padded slot.
    """
    if resampler not in RESAMPLERS:
        raise ValueError(f"resampler must be one of {list(RESAMPLERS)}, got {resampler!r}")
    B, n = log_weights.shape
    dtype = torch.promote_types(log_weights.dtype, torch.float32)
    log_weights = log_weights.detach().to(dtype).masked_fill(~mask, -math.inf)
    weights = (log_weights - log_weights.amax(-1, keepdim=True)).exp()  # padded: 0 (a row has a real token)
    cumulative = weights.cumsum(-1)
    total = cumulative[:, -1:]
    count = mask.sum(-1, keepdim=True).to(dtype)
    rank = (mask.cumsum(-1) - 1).clamp(min=0).to(dtype)

    def uniform(shape):  # in (0, 1]
        return 1 - torch.rand(shape, device=weights.device, dtype=dtype, generator=generator)

    if deterministic:
        fraction = (rank + 0.5) / count
    elif resampler == "multinomial":
        fraction = uniform((B, n))
    elif resampler == "stratified":
        fraction = (rank + uniform((B, n))) / count
    else:
        fraction = (rank + uniform((B, 1))) / count
    positions = fraction.clamp(max=1.0) * total
    ancestors = (cumulative[:, None, :] < positions[:, :, None]).sum(-1).clamp(max=n - 1)
    return torch.where(mask, ancestors, torch.arange(n, device=mask.device))


class ParticleTransformer(nn.Module, PretrainedMixin):
    def __init__(self, config: ParticleConfig, generator: torch.Generator | None = None):
        super().__init__()
        refuse_non_finite_weights(self)  # NaN/inf weights are refused where they enter
        self.config, self.generator = config, generator
        self.embedding = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.max_length, config.width)
        self.blocks = nn.ModuleList(
            Block(config.width, config.heads, config.ffn_width, config.dropout) for _ in range(config.layers)
        )
        if config.resampling == "mix":  # only the mixing has parameters of its own
            self.resample_norm = nn.LayerNorm(config.width)
            self.resample_value = nn.Linear(config.width, config.width)
        self.final_norm = nn.LayerNorm(config.width)
        outputs = config.vocab_size if config.task == "mlm" else config.num_classes
        self.head = TaskHead(config.task, config.width, outputs, config.pooling)

    def resample_mix(self, x, attention, mask, active):
        """``resampling="mix"``: each position draws a source from its attention row and adds
        ``W LN(x_source)``; rows not ``active`` are left unchanged. Returns (x, sources)."""
        logits = attention.clamp(min=1e-30).log().masked_fill(~mask[:, None, :], -math.inf)
        if self.training:
            u = torch.rand(logits.shape, device=x.device, dtype=logits.dtype, generator=self.generator)
            scores = logits - (-u.clamp(min=1e-20).log()).log()  # + Gumbel noise
            soft = (scores / self.config.temperature).softmax(-1)
            sources = scores.argmax(-1)
            if self.config.relaxation == "straight-through":
                hard = one_hot(sources, x.shape[1], soft.dtype)
                choice = hard + soft - soft.detach()
            else:
                choice = soft
            moved = x + choice @ self.resample_value(self.resample_norm(x))
        else:  # a fixed rule at inference: the most attended source, gathered (no one-hot of size n)
            sources = logits.argmax(-1)
            moved = x + self.resample_value(self.resample_norm(x)).gather(1, sources[..., None].expand_as(x))
        identity = torch.arange(x.shape[1], device=x.device)
        return torch.where(active[:, None, None], moved, x), torch.where(active[:, None], sources, identity)

    def resample_copy(self, x, log_weights, mask, active):
        """``resampling="copy"``: ``x_i <- x_a(i) + p_i`` in the real slots of ``active`` rows
        (the estimator and the position term: the module docstring). Returns (x, ancestors)."""
        n = x.shape[1]
        ancestors = draw_ancestors(
            log_weights, mask, self.config.resampler, self.generator, deterministic=not self.training
        )
        copied = x.gather(1, ancestors[..., None].expand_as(x))
        log_w = log_weights.masked_fill(~mask, -math.inf).log_softmax(-1).masked_fill(~mask, 0.0)  # finite
        weights = log_w.exp() * mask
        mean = (weights[..., None].to(x.dtype) * x).sum(1, keepdim=True).detach()  # the baseline xbar
        score = log_w.gather(1, ancestors)
        moved = copied + (score - score.detach())[..., None].to(x.dtype) * (copied - mean)  # exactly copied
        moved = moved + self.position(torch.arange(n, device=x.device))
        keep = active[:, None] & mask
        identity = torch.arange(n, device=x.device)
        return torch.where(keep[..., None], moved, x), torch.where(keep, ancestors, identity)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        c, device = self.config, self.embedding.weight.device
        tokens, mask = check_token_inputs(tokens, mask, c.vocab_size, c.max_length, device)
        refuse_non_finite_parameters(self)  # a weight overwritten in memory: refused by name, no host read
        B, n = tokens.shape
        x = self.embedding(tokens) + self.position(torch.arange(n, device=tokens.device))
        padding = torch.where(mask, 0.0, -math.inf).to(x.dtype)
        log_weights = torch.zeros(B, n, device=x.device, dtype=x.dtype).masked_fill(~mask, -math.inf)
        identity = torch.arange(n, device=x.device).expand(B, n)
        trace = {"log_weights": [], "ess": [], "resampled": [], "ancestors": [], "hidden": [], "attention": []}
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
            trace["log_weights"].append(log_weights)  # before resampling resets them: what ess reads
            resampled, ancestors = torch.zeros(B, dtype=torch.bool, device=x.device), identity
            if self.config.resampling != "none" and (index + 1) % self.config.resample_every == 0:
                always = self.config.ess_threshold >= 1
                resampled = torch.ones_like(resampled) if always else ess < self.config.ess_threshold
                if self.config.resampling == "copy":
                    x, ancestors = self.resample_copy(x, log_weights, mask, resampled)
                else:
                    x, ancestors = self.resample_mix(x, attention, mask, resampled)
                log_weights = torch.where(resampled[:, None] & mask, 0.0, log_weights)
            trace["ess"].append(ess)
            trace["resampled"].append(resampled)
            trace["ancestors"].append(ancestors)
            trace["hidden"].append(x)
            trace["attention"].append(per_head)
        logits = self.head(self.final_norm(x), mask)
        return logits, {k: torch.stack(v) for k, v in trace.items()}

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): per layer the
        token states ``hidden [L, B, n, D]``, attention ``[L, B, H, n, n]`` and the
        importance log-weights ``[L, B, n]`` before each layer's resampling."""
        _, trace = self(tokens, mask)
        return {"hidden": trace["hidden"], "attention": trace["attention"], "log_weights": trace["log_weights"]}
