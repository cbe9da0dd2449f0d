"""The transformer block shared by the non-CRF models (the Particle Transformer, the
BERT-style and Universal-Transformer baselines): pre-LN by default, post-LN (the
original BERT ordering) as an option."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "NORMS", "check_token_inputs"]

NORMS = ("pre", "post")


def check_token_inputs(tokens, mask, vocab_size: int, max_length: int):
    """Validated ``(tokens, mask)`` for the models built from ``Block``: integer ids
    ``[B, n]`` with n <= ``max_length``, a bool mask of the same shape (default: all
    real), real ids in ``[0, vocab_size)``, a real token in every row; padded ids -> 0."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise ValueError(f"tokens must be integer ids of shape [batch, length], got {getattr(tokens, 'shape', tokens)}")
    if tokens.shape[1] > max_length:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_length={max_length}")
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
    if mask.shape != tokens.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape {tuple(tokens.shape)}")
    if not torch.compiler.is_compiling():
        if ((tokens[mask] < 0) | (tokens[mask] >= vocab_size)).any():
            raise ValueError(f"token ids must lie in [0, {vocab_size}) (vocab_size)")
        if (~mask.any(1)).any():
            raise ValueError("every row needs at least one real token")
    return tokens.masked_fill(~mask, 0), mask


class Block(nn.Module):
    """pre-LN: x + attention(LN x), then + FFN(LN x); post-LN: LN(x + attention(x)),
    then LN(x + FFN(x)). ``key_bias [B, n]`` is added to every
    query's scores (padding: -inf); with ``return_attention`` the attention
    probabilities ``[B, heads, n, n]`` are returned too (materialised), otherwise
    torch's fused ``scaled_dot_product_attention`` is used."""

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

    def attend(self, x, key_bias, return_attention=False):
        """Self-attention of x (pre-LN: of LN x)."""
        B, n, width = x.shape
        q, k, v = (
            self.qkv(self.attention_norm(x) if self.norm == "pre" else x)
            .view(B, n, 3, self.heads, -1)
            .permute(2, 0, 3, 1, 4)
        )
        bias = key_bias[:, None, None, :].to(q.dtype)
        p = self.dropout if self.training else 0.0
        if not return_attention:
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
            probs = None
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
            probs = scores.softmax(-1)
            mixed = F.dropout(probs, p, self.training) @ v
        return self.out(mixed.transpose(1, 2).reshape(B, n, width)), probs

    def transition(self, x):
        """The FFN move of x (pre-LN: of LN x)."""
        return F.dropout(self.ffn(self.ffn_norm(x) if self.norm == "pre" else x), self.dropout, self.training)

    def forward(self, x, key_bias, return_attention=False):
        mixed, probs = self.attend(x, key_bias, return_attention)
        x = x + F.dropout(mixed, self.dropout, self.training)
        if self.norm == "post":
            x = self.attention_norm(x)
            return self.ffn_norm(x + self.transition(x)), probs
        return x + self.transition(x), probs
