"""Folded-context mean field: long inputs in memory bounded by one segment.

On ``graphs.topology.segments(l)`` a token's head lies in its own segment or in the
previous one, never in a later one. ``Folded`` runs the mean-field iterations segment by
segment: while segment s is updated, segment s - 1 keeps its *final* label posteriors
(fixed messages, the condensed memory) and later segments do not exist yet. This is
assumed-density filtering: segment s never hears back from s + 1 (the reverse messages
a full mean field would send), the way a Kalman filter never hears from the future.

Two computations of the same quantity:

``folded(tokens, mask)``
    the reference, on whole ``[B, L]`` tensors: for each s, the engine's own iterations
    over all L positions with segments ``<= s`` present and every other segment frozen.
``folded.stream(chunks)``
    a generator over token chunks of any size: it keeps one segment of posteriors
    (``[B, l, d]``) and fewer than l pending tokens, and yields each segment's label
    logits as soon as the segment is complete (the last, partial one at the end).

Both equal each other (tests/inference/mean_field/test_folding.py); only ``stream`` runs in
constant memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from graphs.inputs import check_tokens
from inference.mean_field.engine import MeanField

__all__ = ["Folded", "FoldState", "SegmentStreamState", "segment_stream", "check_state", "check_segment"]


@dataclass(kw_only=True)  # keywords only: a subclass's fields follow these, so positions would mislead
class SegmentStreamState:
    """What every stream over segments keeps between chunks, read and written by
    ``segment_stream``: the tokens of a segment not yet complete and how far the stream
    got. Each stream's own state (``FoldState``) subclasses it and adds its memory."""

    pending_tokens: torch.Tensor | None = None  # [B, < l] not yet a complete segment
    pending_mask: torch.Tensor | None = None
    pending_yielded: int = 0  # of the pending tokens, those already yielded (a partial segment)
    position: int = 0  # tokens already yielded

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


def segment_stream(
    chunks: Iterable, length: int, state: SegmentStreamState, check_ids
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(tokens, mask, yielded)`` per segment of ``length`` tokens from ``chunks`` of any
    size (``[B, k]`` tensors or ``(tokens, mask)`` pairs); the last, partial segment comes
    at the end. Fewer than ``length`` tokens wait in ``state.pending_tokens`` /
    ``state.pending_mask``, and stay there after the partial segment is yielded: the next
    call with the same state completes that segment and computes it again, whole.
    ``yielded``: its leading positions an earlier call already yielded (not to yield
    twice). ``check_ids(tokens)`` validates the ids of a chunk (padding already set to 0: a
    row may be all padding in one chunk) and returns them."""
    for chunk in chunks:
        tokens, mask = chunk if isinstance(chunk, tuple) else (chunk, None)
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"a chunk must be a token tensor or a (tokens, mask) pair, got {type(tokens).__name__}")
        if mask is not None and (
            not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != tokens.shape
        ):
            raise ValueError(f"a chunk's mask must be a bool tensor shaped like its tokens {tuple(tokens.shape)}")
        tokens = check_ids(tokens if mask is None else tokens.masked_fill(~mask, 0))
        mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
        if state.pending_tokens is not None:
            if tokens.shape[0] != state.pending_tokens.shape[0]:
                raise ValueError(f"every chunk needs batch size {state.pending_tokens.shape[0]}, got {tokens.shape[0]}")
            tokens = torch.cat([state.pending_tokens, tokens], 1)
            mask = torch.cat([state.pending_mask, mask], 1)
        while tokens.shape[1] >= length:
            yield tokens[:, :length], mask[:, :length], state.pending_yielded
            state.pending_yielded = 0
            tokens, mask = tokens[:, length:], mask[:, length:]
        state.pending_tokens, state.pending_mask = (tokens, mask) if tokens.shape[1] else (None, None)
    pending = state.pending_tokens
    if pending is not None and pending.shape[1] > state.pending_yielded:
        yield pending, state.pending_mask, state.pending_yielded
        state.pending_yielded = pending.shape[1]


def check_state(state, kind: type, fresh: bool = True):
    """``state``, a ``kind`` (a stream's state); None gives a fresh one where ``fresh``."""
    if state is None and fresh:
        return kind()
    if not isinstance(state, kind):
        allowed = " or None (a fresh stream)" if fresh else f" ({kind.__name__}() for a fresh stream)"
        raise TypeError(f"state must be a {kind.__name__}{allowed}, got {type(state).__name__}")
    return state


def check_segment(tokens, mask, yielded, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, m] long, mask [B, m] bool)`` of one segment's ids (mask None: all real;
    a row may be all padding) as ``graphs.inputs.check_tokens``; ``yielded`` an integer in [0, m]."""
    tokens, mask = check_tokens(tokens, mask, vocab_size, device, empty_rows=True)
    if isinstance(yielded, bool) or not isinstance(yielded, int) or not 0 <= yielded <= tokens.shape[1]:
        raise ValueError(f"yielded must be an integer in [0, {tokens.shape[1]}] (segment tokens), got {yielded!r}")
    return tokens, mask


@dataclass(kw_only=True)
class FoldState(SegmentStreamState):
    """All a stream keeps between chunks; no tensor here has an axis longer than l."""

    memory_logits: torch.Tensor | None = None  # [B, l, d] final logits of the last complete segment
    memory_mask: torch.Tensor | None = None  # [B, l]


class Folded:
    """Streaming (assumed-density) mean field for a ``MeanField`` whose CRF topology is
    ``graphs.topology.segments(l)`` (optionally ``causal=True``)."""

    def __init__(self, mean_field):
        if not isinstance(mean_field, MeanField):
            raise TypeError(f"Folded needs an inference.MeanField, got {type(mean_field).__name__}")
        length = mean_field.crf.topology.segment_length
        if length is None:
            raise ValueError(
                f"Folded needs a CRF on graphs.topology.segments(l), got topology {mean_field.crf.topology.name!r}"
            )
        if mean_field.schedule == "sequential" or mean_field.halting != "none":
            raise ValueError(
                "Folded runs the unrolled schedules ('async', 'parallel', 'macaron') without halting; got "
                f"schedule={mean_field.schedule!r}, halting={mean_field.halting!r}"
            )
        self.mean_field, self.length = mean_field, length

    # ---- the reference: whole tensors ----------------------------------------------------

    def __call__(self, tokens, mask=None) -> torch.Tensor:
        """``[B, L, d]`` label logits of every token (0 on padding), segment by segment."""
        mf = self.mean_field
        tokens, mask = mf.crf.check_inputs(tokens, mask)
        unary = mf.crf.unary_table(tokens, mask)
        segment = torch.arange(tokens.shape[1], device=tokens.device) // self.length
        logits = unary
        for s in range(int(segment[-1]) + 1):
            present = mask & (segment <= s)
            if not (present & (segment == s)).any():
                continue  # every row is padding here
            current = (segment == s).expand_as(mask)
            logits = self._segment(tokens, present, unary, logits, current)
        return logits * mask[..., None]

    def _segment(self, tokens, present, unary, logits, current):
        """The engine's iterations with only ``current`` nodes updated; others frozen."""
        mf = self.mean_field
        # a row with nothing present yet (a stream's first segment is empty in that row)
        # still gets one node so the checks pass; it is frozen and alone, so inert
        present = present | ~present.any(1, keepdim=True) & (torch.arange(present.shape[1], device=present.device) == 0)
        tokens, present, structure = mf.structure(tokens, present)
        kernel = mf.resolved_kernel(structure.nodes.shape[1], tokens.device)
        initial = torch.where(current[..., None], unary, logits)
        new = mf._unrolled(unary, present, structure, kernel, initial=initial, frozen=~current)[0]
        return torch.where(current[..., None], new, logits)

    # ---- streaming -----------------------------------------------------------------------

    def stream(self, chunks: Iterable, state: FoldState | None = None) -> Iterator[torch.Tensor]:
        """Yield ``[B, m, d]`` label logits per segment (m = l, the last may be shorter)
        for ``chunks``: ``[B, k]`` token tensors or ``(tokens, mask)`` pairs of any k; each
        piece covers positions ``state.position - m`` to ``state.position``. Pass a
        ``FoldState`` to inspect what the stream keeps, or to resume it: a call that ended
        on a partial segment keeps it, and the call that completes it yields the whole
        segment again (a mean-field segment's earlier labels change when later tokens join
        it: the new piece replaces the provisional one)."""
        state = check_state(state, FoldState)
        check_ids = self.mean_field.crf.check_inputs
        for tokens, mask, yielded in segment_stream(chunks, self.length, state, lambda ids: check_ids(ids)[0]):
            yield self.push_segment(tokens, mask, state, yielded)

    def push_segment(self, tokens, mask, state: FoldState, yielded: int = 0) -> torch.Tensor:
        """One segment (at most l tokens) against the memory in ``state``; updates it. Its
        first ``yielded`` positions, returned before for a partial segment, are returned
        again but not counted again in ``state.position``."""
        mf = self.mean_field
        state = check_state(state, FoldState, fresh=False)
        tokens, mask = check_segment(tokens, mask, yielded, mf.crf.vocab_size, mf.crf.unary.device)
        B, m = tokens.shape
        if m > self.length:
            raise ValueError(f"a segment has at most l={self.length} tokens, got {m}")
        if state.memory_logits is not None and B != state.memory_logits.shape[0]:
            raise ValueError(f"every chunk needs batch size {state.memory_logits.shape[0]}, got {B}")
        d = mf.crf.labels
        if state.memory_logits is None:  # the first segment: an absent memory
            memory_logits = mf.crf.unary.new_zeros(B, self.length, d)
            memory_mask = torch.zeros(B, self.length, dtype=torch.bool, device=tokens.device)
        else:
            memory_logits, memory_mask = state.memory_logits, state.memory_mask
        window_tokens = torch.cat([torch.zeros_like(memory_mask, dtype=torch.long), tokens.long()], 1)
        present = torch.cat([memory_mask, mask], 1)
        current = torch.cat([torch.zeros_like(memory_mask), torch.ones_like(mask)], 1)
        unary = mf.crf.unary_table(window_tokens.masked_fill(~present, 0), present)
        logits = torch.cat([memory_logits, unary[:, self.length :]], 1)
        out = self._segment(window_tokens, present, unary, logits, current)[:, self.length :]
        out = out * mask[..., None]
        if m == self.length:
            state.memory_logits, state.memory_mask = out, mask
        state.position += m - yielded
        return out
