"""Value checks without a host read (issue 19): a forward may refuse bad values (token ids
out of range, a NaN potential) without waiting for the device.

``torch._assert_async`` checks a condition on the tensor's own device. On the CPU it fails at
once, and the full message, which may read values to name the culprit, is built then, on the
failure path only. On a GPU the forward goes on and a false condition fails as a device-side
assert at the next synchronisation, with ``message`` in the kernel's log.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["refuse_unless"]


def refuse_unless(condition: torch.Tensor, message: str, full_message: Callable[[], str] | None = None) -> None:
    """``ValueError`` (``full_message()`` if given, else ``message``) unless ``condition``,
    a bool tensor, is true; no host read while it is."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError as error:
        if message not in str(error):
            raise
        raise ValueError(full_message() if full_message is not None else message) from None
