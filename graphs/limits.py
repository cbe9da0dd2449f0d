"""The most each size of a factor graph may be: absurd sizes are refused with
an error naming the size and its limit before anything is allocated.

``LIMITS`` is the one table for the CRF's sizes: ``graphs.CRF`` enforces it and
``probformer.models.config.LIMITS`` reads it (graphs cannot import probformer;
probformer imports graphs). A topology's mask is a dense ``[N, N]`` bool: ``2**16``
nodes are already 4 GiB.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

__all__ = [
    "is_integer",
    "is_real",
    "is_switch",
    "LIMITS",
    "MAX_PARAMETERS",
    "MAX_EMBEDDING_SIZE",
    "MAX_NODES",
    "MAX_CLUSTERS",
    "MAX_REACH",
    "check_size",
    "check_parameter_count",
    "check_length",
    "check_positive",
]

LIMITS: dict[str, int] = {
    "vocab_size": 2**24,
    "labels": 2**16,
    "channels": 2**10,
    "rank": 2**14,
    "global_labels": 2**20,
    "gamma": 2**12,
    "ternary_blocks": 2**10,
}
MAX_PARAMETERS = 2**31  # all the CRF's parameters together: 8 GiB of float32
MAX_EMBEDDING_SIZE = 2**24  # D of CRF(embedding_size=D): rows of the unary table, as vocab_size

MAX_NODES = 2**16  # sentence length plus virtual nodes, of one mask
MAX_CLUSTERS = 2**14  # clusters(k): k cluster nodes, k**2 arcs among them
MAX_REACH = 2**20  # window(w), segments(l): an offset, no memory of its own


def check_size(name: str, value, minimum: int, maximum: int | None = None) -> None:
    """A CRF size: an integer from ``minimum`` to ``maximum`` (default: its ``LIMITS`` entry)."""
    maximum = LIMITS[name] if maximum is None else maximum
    if isinstance(value, bool) or not isinstance(value, int):  # a wrong type: TypeError, the same words
        raise TypeError(f"{name} must be an integer >= {minimum} and <= {maximum} (the limit), got {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer >= {minimum} and <= {maximum} (the limit), got {value!r}")


def check_parameter_count(vocab_size, labels, channels, rank, global_labels, gamma, ternary_blocks) -> None:
    """Each size within its limit can still multiply to an absurd total: refuse it before
    allocating. An upper bound over the forms (the largest ternary form, +1 group for a
    virtual-node topology, product keys at most 2 labels per sub-key)."""
    groups = 2 * (gamma + 1) + 1
    ternary = (
        groups * ternary_blocks * (2 * labels * rank + channels * rank * rank) + 2 * groups * channels * labels * rank
    )
    total = vocab_size * labels + ternary + global_labels * labels + 2 * math.isqrt(global_labels) * labels
    if total > MAX_PARAMETERS:
        raise ValueError(
            f"CRF(vocab_size={vocab_size}, labels={labels}, channels={channels}, rank={rank}, "
            f"global_labels={global_labels}, gamma={gamma}, ternary_blocks={ternary_blocks}) would have about "
            f"{total:,} parameters, more than the limit {MAX_PARAMETERS:,} (2**31): reduce its sizes"
        )


def check_length(n, extra_nodes: int = 0) -> int:
    """A sentence length ``n`` >= 1 whose mask, with ``extra_nodes`` virtual nodes, stays
    within ``MAX_NODES``."""
    if isinstance(n, torch.SymInt):  # a symbolic length while tracing for export: checked at run time
        return n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sentence length n must be an integer >= 1, got {n!r}")
    if n + extra_nodes > MAX_NODES:
        raise ValueError(
            f"sentence length n = {n} plus {extra_nodes} virtual nodes exceeds the limit of {MAX_NODES} nodes "
            f"(a dense [N, N] mask)"
        )
    return n


def check_positive(name: str, value, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an integer >= 1 and <= {maximum} (the limit), got {value!r}")
    return value


def is_integer(value) -> bool:
    """A Python or numpy integer; never a bool (True would read as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def is_real(value) -> bool:
    """A Python or numpy real number; never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def is_switch(value) -> bool:
    """A Python or numpy bool: anything else read by bool() would turn "false" into True."""
    return isinstance(value, bool | np.bool_)
