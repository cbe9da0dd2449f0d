"""Named points where a test can make the trainer kill itself with SIGKILL.

``PROBFORMER_CRASH_AT=<point>`` (or ``<point>@<n>``: the n-th time the point is
reached, counting from 1) makes the process send itself SIGKILL there, so the
kill-and-resume tests can stop a run exactly inside a save, between a rename and
the pointer update, or halfway through a metrics line, instead of hoping a random
delay lands there. Unset (always, outside tests) the check is one dict lookup.

The points, in the order a step reaches them: ``step`` (after the optimiser step),
``metrics:partial`` (half a metrics line written), ``metrics:written``,
``save:weights`` (temporary checkpoint has its weights only), ``save:temporary``
(temporary complete), ``save:renamed`` (renamed, pointer not moved),
``save:pointer`` (pointer moved, old checkpoint not yet pruned), ``swap:moved`` (a
``model/`` or ``best/`` being replaced: the old one moved aside, the new one not yet
in), ``best:model`` (a new
best validation's ``best/`` folder written, its step's checkpoint not yet), ``final:logged``,
``final:model`` (final model folder written, summary not yet).
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "ENVIRONMENT", "reached"]

ENVIRONMENT = "PROBFORMER_CRASH_AT"
POINTS = (
    "step",
    "metrics:partial",
    "metrics:written",
    "save:weights",
    "save:temporary",
    "save:renamed",
    "save:pointer",
    "swap:moved",
    "best:model",
    "final:logged",
    "final:model",
)
_counts: dict[str, int] = {}


def reached(point: str) -> None:
    """SIGKILL this process if ``PROBFORMER_CRASH_AT`` names ``point`` (and this is the
    n-th time it is reached)."""
    wanted = os.environ.get(ENVIRONMENT)
    if not wanted:
        return
    name, _, nth = wanted.partition("@")
    if name not in POINTS:
        raise ValueError(f"{ENVIRONMENT}={wanted!r}: the point must be one of {list(POINTS)}")
    if name != point:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
