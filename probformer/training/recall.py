"""A synthetic long-range recall task: a key must be reproduced many tokens later.

A sequence is random filler words with, somewhere, the marker ``KEY`` followed by a key
value, and ``distance`` tokens after the key value the marker ``QUERY``; the next token
is the key value again. A causal language model is scored only there: at the ``QUERY``
position it must predict the key. Chance is ``1 / keys``. Nothing but memory of the key
solves it, so accuracy against distance measures how far a model's context reaches.

Vocabulary: fillers ``0 .. fillers - 1``, then ``KEY``, ``QUERY``, then the key values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probformer.training.corpus import IGNORE

__all__ = ["RecallTask"]


@dataclass(frozen=True)
class RecallTask:
    keys: int = 8  # distinct key values
    fillers: int = 16  # distinct filler words
    offset: int = 12  # the key starts at a random position in [0, offset)

    def __post_init__(self):
        for name in ("keys", "fillers", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RecallTask {name} must be an integer >= 1, got {value!r}")

    @property
    def key_marker(self) -> int:
        return self.fillers

    @property
    def query_marker(self) -> int:
        return self.fillers + 1

    @property
    def vocab_size(self) -> int:
        return self.fillers + 2 + self.keys

    def length(self, distance: int) -> int:
        """The sequence length used for ``distance`` (room for any start offset)."""
        return self.offset + distance + 3

    def batch(self, batch_size: int, distance: int, generator: torch.Generator | None = None):
        """``(tokens [B, n], targets [B, n])``: targets are ``IGNORE`` except at the query,
        where they hold the key (the token that follows). ``distance`` >= 1 counts the
        positions from the key value to the query."""
        if isinstance(distance, bool) or not isinstance(distance, int) or distance < 1:
            raise ValueError(f"distance must be an integer >= 1, got {distance!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        n = self.length(distance)
        tokens = torch.randint(0, self.fillers, (batch_size, n), generator=generator)
        start = torch.randint(0, self.offset, (batch_size,), generator=generator)
        key = self.fillers + 2 + torch.randint(0, self.keys, (batch_size,), generator=generator)
        rows = torch.arange(batch_size)
        query = start + 1 + distance
        tokens[rows, start] = self.key_marker
        tokens[rows, start + 1] = key
        tokens[rows, query] = self.query_marker
        tokens[rows, query + 1] = key
        targets = torch.full_like(tokens, IGNORE)
        targets[rows, query] = key
        return tokens, targets
