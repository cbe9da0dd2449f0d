"""The torch building blocks the models are made of, written once and used by training
and by every export alike (torch alone: no Pyro, NumPyro, JAX, ArviZ or networkx).

    check_token_inputs   validated (tokens, mask); value checks skipped while tracing
    refuse_unless        a value check without a host read (a device-side assert)
    one_hot              F.one_hot without its host read of the indices
    window_attention     attention to i - left .. i + right, O(n w) memory
    Block                a pre-/post-LN transformer block (SDPA, or materialised attention)
    TaskHead             the mlm / tagging / classification head
    log_attention_mass, normalised_ess
                         the Particle Transformer's importance weights
    non_finite, refuse_non_finite_weights
                         the one finite-weights check (load_state_dict refuses NaN/inf)

Every forward maps ``tokens [B, n]`` and ``mask [B, n]`` with no data-dependent Python
control flow, so a model built from these traces into a fixed graph (torch.export,
ONNX) with a dynamic batch and length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from graphs.device_checks import refuse_unless  # one implementation, shared with graphs.CRF
from graphs.inputs import check_token_types

__all__ = [
    "Block",
    "window_attention",
    "TaskHead",
    "check_token_inputs",
    "refuse_unless",
    "one_hot",
    "log_attention_mass",
    "normalised_ess",
    "NORMS",
    "TASKS",
    "POOLINGS",
    "non_finite",
    "refuse_non_finite_weights",
]

NORMS = ("pre", "post")
TASKS = ("mlm", "tagging", "classification")
POOLINGS = ("mean", "root")


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def check_token_inputs(tokens, mask, vocab_size: int, max_length: int | None = None, device=None):
    """Validated ``(tokens, mask)``: integer ids ``[B, n]`` (n <= ``max_length`` if given)
    on ``device`` (the model's, if given), a bool mask of the same shape (default: all real),
    real ids in ``[0, vocab_size)``, a real token in every row; padded ids -> 0. Value checks
    are skipped while tracing."""
    mask = check_token_types(tokens, mask, device)  # TypeError / ValueError, the engines' own messages
    if max_length is not None and tokens.shape[1] > max_length:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_length={max_length}")
    if not _tracing():
        outside = mask & ((tokens < 0) | (tokens >= vocab_size))
        refuse_unless(~outside.any(), f"token ids must lie in [0, {vocab_size}) (vocab_size)")
        refuse_unless(mask.any(1).all(), "every row needs at least one real token")
    return tokens.long().masked_fill(~mask, 0), mask


def one_hot(index: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """``[..., classes]`` one-hot rows of ``index`` in ``dtype``. ``F.one_hot`` reads the
    indices' range on the host (a synchronisation on a GPU); a comparison does not."""
    return (index[..., None] == torch.arange(classes, device=index.device)).to(dtype)


# ---- building blocks of the trainable models ---------------------------------------


def window_attention(q, k, v, key_bias, left: int, right: int, dropout_p: float = 0.0):
    """Attention of each query i to the keys i - left .. i + right only, never across the
    ends of the sequence: ``q, k, v [B, H, n, dh]``, ``key_bias [B, n]`` (padding -inf).
    O(n (left + right + 1) dh) time and memory, against O(n^2 dh) for a banded mask: the
    keys are gathered into windows. A query with no allowed key (padding) attends to
    itself, so nothing turns into NaN."""
    n = q.shape[2]
    # key positions i - left .. i + right per query, gathered (not unfolded from a padded
    # copy), so a traced length stays symbolic; positions outside the sequence are masked
    window = torch.arange(n, device=q.device)[:, None] + torch.arange(-left, right + 1, device=q.device)
    inside = (window >= 0) & (window < n)  # [n, width]
    window = window.clamp(0, n - 1)
    windowed_keys, windowed_values = k[:, :, window], v[:, :, window]  # [B, H, n, width, dh]
    bias = key_bias[:, window].masked_fill(~inside, float("-inf"))  # [B, n, width]
    allowed = torch.isfinite(bias)
    itself = torch.arange(left + right + 1, device=q.device) == left
    allowed = allowed | (~allowed.any(-1, keepdim=True) & itself)
    scores = (q[..., None, :] @ windowed_keys.transpose(-1, -2)).squeeze(-2) / math.sqrt(q.shape[-1])
    bias = torch.where(allowed, torch.where(torch.isfinite(bias), bias, 0.0), float("-inf"))
    scores = scores + bias[:, None].to(scores.dtype)  # [B, H, n, width]
    probs = F.dropout(scores.softmax(-1), dropout_p, dropout_p > 0)
    return (probs[..., None, :] @ windowed_values).squeeze(-2)  # [B, H, n, dh]


class Block(nn.Module):
    """pre-LN: x + attention(LN x), then + FFN(LN x); post-LN: LN(x + attention(x)),
    then LN(x + FFN(x)). ``key_bias [B, n]`` is added to every
    query's scores (padding: -inf); with ``return_attention`` the attention
    probabilities ``[B, heads, n, n]`` are returned too (materialised), otherwise
    torch's fused ``scaled_dot_product_attention`` is used. ``window=(left, right)``
    restricts query i to keys i - left .. i + right (``window_attention``)."""

    def __init__(self, width: int, heads: int, ffn_width: int, dropout: float = 0.0, norm: str = "pre"):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {list(NORMS)}, got {norm!r}")
        self.heads, self.dropout, self.norm = heads, dropout, norm
        self.attention_norm, self.ffn_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn_width), nn.GELU(), nn.Linear(ffn_width, width))

    def attend(self, x, key_bias, return_attention=False, window=None):
        """Self-attention of x (pre-LN: of LN x)."""
        B, n, width = x.shape
        q, k, v = (
            self.qkv(self.attention_norm(x) if self.norm == "pre" else x)
            .view(B, n, 3, self.heads, -1)
            .permute(2, 0, 3, 1, 4)
        )
        p = self.dropout if self.training else 0.0
        probs = None
        if window is not None:
            mixed = window_attention(q, k, v, key_bias.to(q.dtype), window[0], window[1], p)
        elif not return_attention:
            mixed = F.scaled_dot_product_attention(
                q, k, v, attn_mask=key_bias[:, None, None, :].to(q.dtype), dropout_p=p
            )
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + key_bias[:, None, None, :].to(q.dtype)
            probs = scores.softmax(-1)
            mixed = F.dropout(probs, p, self.training) @ v
        return self.out(mixed.transpose(1, 2).reshape(B, n, width)), probs

    def transition(self, x):
        """The FFN move of x (pre-LN: of LN x)."""
        return F.dropout(self.ffn(self.ffn_norm(x) if self.norm == "pre" else x), self.dropout, self.training)

    def forward(self, x, key_bias, return_attention=False, window=None):
        mixed, probs = self.attend(x, key_bias, return_attention, window)
        x = x + F.dropout(mixed, self.dropout, self.training)
        if self.norm == "post":
            x = self.attention_norm(x)
            return self.ffn_norm(x + self.transition(x)), probs
        return x + self.transition(x), probs


class TaskHead(nn.Module):
    """mlm: a linear decoder to the vocabulary at every token (untied, with bias, as the
    PT reference); tagging: a linear layer to ``num_classes`` at every token;
    classification: ``num_classes`` logits per sentence from the mean over real tokens
    ("mean") or from the ROOT node ("root"; ``root``: its index among the virtual nodes,
    which follow the n tokens)."""

    def __init__(self, task: str, width: int, num_outputs: int, pooling: str = "mean", root: int = 0):
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: {list(TASKS)}")
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; allowed: {list(POOLINGS)}")
        self.task, self.pooling, self.root = task, pooling, root
        self.decoder = nn.Linear(width, num_outputs)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = mask.shape[1]
        if self.task != "classification":
            return self.decoder(hidden[:, :n])  # [B, n, outputs]
        if self.pooling == "root":
            return self.decoder(hidden[:, n + self.root])
        weights = mask[..., None].to(hidden.dtype)
        pooled = (hidden[:, :n] * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.decoder(pooled)  # [B, outputs]


# ---- importance weights of the Particle Transformer (attention mass as weight) ------------


def log_attention_mass(attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` log of the attention each real token receives, relative to the mean (1)."""
    mass = (attention * mask[:, :, None]).sum(1)  # sums to the number of real tokens
    return torch.where(mask, mass.clamp(min=1e-30).log(), -math.inf)


def normalised_ess(log_weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` ESS / (number of real tokens) of per-token log-weights."""
    ess = (2 * log_weights.logsumexp(-1) - (2 * log_weights).logsumexp(-1)).exp()
    return ess / mask.sum(-1)


# ---- checking stored weights -------------------------------------------------------


def non_finite(tensors: dict) -> list[str]:
    """The names of the floating tensors in ``tensors`` that hold a NaN or an infinity, in
    order (one host read for all of them). Every finite-weights check uses this."""
    floating = [(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    floating = [(name, t) for name, t in floating if t.numel()]
    if not floating:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in floating]).tolist()
    return [name for (name, _), ok in zip(floating, finite) if not ok]


def _check_finite_state(module, state_dict, prefix, *args) -> None:
    if prefix:  # the whole state is checked once, at the top, before anything is copied
        return
    bad = non_finite(state_dict)
    if bad:
        raise ValueError(
            f"weight {bad[0]!r} holds NaN or infinite values; {type(module).__name__}.load_state_dict "
            "refuses it (the model is unchanged)"
        )


def refuse_non_finite_weights(model: nn.Module) -> None:
    """Make ``model.load_state_dict`` refuse NaN or infinite weights before it copies any:
    non-finite numbers are stopped where they enter (loading; the trainer checks each
    optimiser step), so no forward needs a host synchronisation to look for them."""
    model.register_load_state_dict_pre_hook(_check_finite_state)
