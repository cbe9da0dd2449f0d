"""Head kernels compute in float32 or wider, whatever autocast is active.

A head kernel's reverse messages divide by row normalisers computed elsewhere
(exp(score - lse of another row)), and its log-normalisers reach hundreds: at bfloat16's 8
bits a log-normaliser of 430 is rounded by about 2, a factor e^2 on every message that
reads it. Autocast would cast the kernels' matmuls (and flex_attention's q, k and v) to
bfloat16, so every kernel runs with autocast disabled, its half-precision inputs cast up to
float32; its results stay float32 (autocast casts them again where a later op wants).
Outside autocast nothing changes: half-precision inputs are the kernels' own business
(each computes them in float32 and returns their type).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["full_precision"]

_HALF = (torch.float16, torch.bfloat16)


def _wide(value):
    if isinstance(value, tuple):  # projections given as their groups
        return tuple(map(_wide, value))
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.to(torch.float32)
    return value


def full_precision(kernel):
    """Decorate a kernel whose first argument is a tensor (or a tuple of them): under autocast
    on its device, run it outside autocast with half-precision tensor arguments in float32."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        device = (args[0][0] if isinstance(args[0], tuple) else args[0]).device.type
        if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
            return kernel(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return kernel(*map(_wide, args), **{name: _wide(value) for name, value in kwargs.items()})

    return run
