"""Value checks without a host read: a forward may refuse bad values (token ids
out of range, a NaN potential) without waiting for the device.

``torch._assert_async`` checks a condition on the tensor's own device. On the CPU it fails at
once, and the full message, which may read values to name the culprit, is built then, on the
failure path only. On a GPU the forward goes on and a false condition fails as a device-side
assert at the next synchronisation, with ``message`` in the kernel's log.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["refuse_unless", "refuse_non_finite", "refuse_non_finite_parameters"]


def refuse_unless(condition: torch.Tensor, message: str, full_message: Callable[[], str] | None = None) -> None:
    """``ValueError`` (``full_message()`` if given, else ``message``) unless ``condition``,
    a bool tensor, is true; no host read while it is."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError as error:
        if message not in str(error):
            raise
        raise ValueError(full_message() if full_message is not None else message) from None


def refuse_non_finite(
    name: str, value: torch.Tensor, where: torch.Tensor | None = None, given: torch.Tensor | None = None
) -> None:
    """``ValueError`` naming ``name`` if a floating ``value`` holds NaN or an infinity (only
    at the positions where the bool ``where`` is true, broadcast from the left, when given);
    a device-side check (no host read unless it fails), skipped while compiling or exporting.
    ``given``: what the caller passed, ``value`` being its cast into the CRF's dtype: a value
    finite as given is named as an overflow of that dtype."""
    if not value.dtype.is_floating_point or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return
    finite = torch.isfinite(value)
    if where is not None:
        finite = finite | ~where.reshape(*where.shape, *[1] * (value.dim() - where.dim()))

    def naming_the_first():
        bad = (~finite).nonzero()[0].tolist()
        held = (value if given is None else given)[tuple(bad)].item()
        if math.isfinite(held):
            return (
                f"{name} holds {held:g} (first at index {bad}), which overflows {value.dtype} (largest finite "
                f"{torch.finfo(value.dtype).max:g}), the CRF's dtype; scale it into range or cast the CRF"
            )
        return f"{name} contains NaN or Inf (first at index {bad}, value {held}); it must be finite"

    refuse_unless(
        finite.all(), f"{name} contains NaN or Inf, or overflows its dtype; it must be finite", naming_the_first
    )


def refuse_non_finite_parameters(module: torch.nn.Module) -> None:
    """``ValueError`` naming the first parameter of ``module`` that holds NaN or an infinity;
    one fused pass over every parameter (the largest magnitude of each: NaN or inf exactly
    when the parameter has one) and no host read unless one does. Skipped while compiling or
    exporting."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return
    named = [(name, p) for name, p in module.named_parameters() if p.is_floating_point() and p.numel()]
    if not named:
        return
    with torch.no_grad():
        peaks = torch._foreach_norm([p for _, p in named], ord=float("inf"))
        finite = torch.stack([peak.float() for peak in peaks]).isfinite()

    def naming_the_first():
        first = named[int((~finite).nonzero()[0, 0])][0]
        return f"parameter {first!r} of {type(module).__name__} contains NaN or Inf; parameters must be finite"

    refuse_unless(finite.all(), "a parameter contains NaN or Inf; parameters must be finite", naming_the_first)
