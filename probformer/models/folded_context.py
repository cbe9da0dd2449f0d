"""Folded-context condensation: a causal language model with a long reach from a short
window (the network view of ``graphs.topology.segments(l, causal=True)``).

The input is cut into segments of ``segment`` (l) tokens. A *local* stack evolves each
segment on its own (causal within the segment). A *global* stack then lets segment s
attend, causally, to the evolved states of segment s - 1 (the condensed memory) together
with its own: it runs over the ``2 l`` states ``[memory, segment]`` and its outputs for
the segment become both the segment's representation and the next segment's memory.
Information is folded forward one segment at a time, so the reach is unbounded while
every attention sees at most ``2 l`` positions and the state carried is ``[B, l, width]``.

``folded=False`` gives the plain windowed baseline with the very same parameters: every
block attends causally to the previous ``segment`` tokens of the whole sequence (a
sliding window, no memory), so its reach is ``layers * segment`` tokens.

``model(tokens)`` computes the whole input at once (the local stack batched over
segments); ``model.stream(chunks)`` yields the same logits segment by segment in
constant memory (``FoldedStreamState`` is all it keeps).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphs.device_checks import refuse_non_finite_parameters, refuse_unless
from inference.mean_field.folding import SegmentStreamState, check_segment, check_state, segment_stream
from probformer.models.blocks import Block, check_token_inputs, refuse_non_finite_weights
from probformer.models.config import ConfigMixin
from probformer.models.pretrained import PretrainedMixin

__all__ = ["FoldedContextConfig", "FoldedContext", "FoldedStreamState"]


@dataclass
class FoldedContextConfig(ConfigMixin):
    vocab_size: int
    width: int = 128
    heads: int = 4
    local_layers: int = 2
    global_layers: int = 2
    ffn_width: int = 512
    segment: int = 12  # l: the window every attention is limited to
    dropout: float = 0.0
    folded: bool = True  # False: the plain sliding-window baseline (same parameters)

    def __post_init__(self):
        self.check_integers(
            {"vocab_size": 1, "width": 1, "heads": 1, "local_layers": 1, "global_layers": 1, "ffn_width": 1}
        )
        self.check_integers({"segment": 1})
        if self.width % self.heads:
            raise ValueError(f"config key 'width' ({self.width}) must be divisible by 'heads' ({self.heads})")
        self.check_dropout()
        self.check_flags("folded")


@dataclass(kw_only=True)
class FoldedStreamState(SegmentStreamState):
    """What a stream keeps between chunks: no tensor here has an axis longer than l."""

    memory: torch.Tensor | None = None  # [B, l, width] global states of the last complete segment
    memory_mask: torch.Tensor | None = None  # [B, l]


class FoldedContext(nn.Module, PretrainedMixin):
    def __init__(self, config: FoldedContextConfig):
        super().__init__()
        refuse_non_finite_weights(self)  # NaN/inf weights are refused where they enter
        self.config = config
        c = config
        self.embedding = nn.Embedding(c.vocab_size, c.width)
        self.position = nn.Embedding(c.segment, c.width)  # position within the segment
        self.local_blocks = nn.ModuleList(
            Block(c.width, c.heads, c.ffn_width, c.dropout) for _ in range(c.local_layers)
        )
        self.global_blocks = nn.ModuleList(
            Block(c.width, c.heads, c.ffn_width, c.dropout) for _ in range(c.global_layers)
        )
        self.final_norm = nn.LayerNorm(c.width)
        self.decoder = nn.Linear(c.width, c.vocab_size)

    def _bias(self, mask):
        return torch.zeros(mask.shape, dtype=self.decoder.weight.dtype, device=mask.device).masked_fill(
            ~mask, float("-inf")
        )

    def _embed(self, tokens, start: int = 0):
        l = self.config.segment
        position = (torch.arange(tokens.shape[1], device=tokens.device) + start) % l
        x = self.embedding(tokens) + self.position(position)
        return F.dropout(x, self.config.dropout, self.training)

    def _local(self, x, mask):
        """The local stack on segments ``[B', l', width]`` (causal within each)."""
        bias = self._bias(mask)
        for block in self.local_blocks:
            x = block(x, bias, window=(x.shape[1] - 1, 0))[0]
        return x

    def _fold(self, states, mask, memory, memory_mask):
        """The global stack on ``[memory, segment]``: the segment's outputs, which are
        also the next memory."""
        m = states.shape[1]
        x = torch.cat([memory, states], 1)
        bias = self._bias(torch.cat([memory_mask, mask], 1))
        for block in self.global_blocks:
            x = block(x, bias, window=(x.shape[1] - 1, 0))[0]
        return x[:, -m:]

    def _empty_memory(self, states):
        B, _, width = states.shape
        l = self.config.segment
        return states.new_zeros(B, l, width), torch.zeros(B, l, dtype=torch.bool, device=states.device)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None):
        """Next-token logits ``[B, L, vocab]`` (position i predicts token i + 1) and the
        final hidden states ``[B, L, width]``. Padding must come at the end of a row."""
        tokens, mask = check_token_inputs(tokens, mask, self.config.vocab_size, device=self.embedding.weight.device)
        refuse_non_finite_parameters(self)  # a weight overwritten in memory: refused by name, no host read
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):  # segments count from position 0
            refuse_unless(
                ~(mask[:, 1:] & ~mask[:, :-1]).any(),
                "FoldedContext needs each row's padding at its end (mask: True, then False): a real token after "
                "padding would sit at another position in its segment and give other logits",
            )
        if not self.config.folded:
            return self._windowed(tokens, mask)
        B, L = tokens.shape
        l = self.config.segment
        segments = -(-L // l)
        pad = segments * l - L
        x = self._embed(F.pad(tokens, (0, pad)))
        padded_mask = F.pad(mask, (0, pad), value=False)
        # the local stack sees each segment alone: all segments in one batch
        local = self._local(x.view(B * segments, l, -1), padded_mask.reshape(B * segments, l)).view(B, segments, l, -1)
        memory, memory_mask = self._empty_memory(x)
        outputs = []
        for s in range(segments):
            segment_mask = padded_mask[:, s * l : (s + 1) * l]
            memory = self._fold(local[:, s], segment_mask, memory, memory_mask)
            memory_mask = segment_mask
            outputs.append(memory)
        hidden = self.final_norm(torch.cat(outputs, 1)[:, :L])
        return self.decoder(hidden), hidden

    def diagnostic_trace(self, tokens, mask=None) -> dict:
        """The diagnostics protocol (``probformer.diagnostics.report``): the final token
        states as one layer, ``hidden [1, B, L, width]``. The attention runs segment by
        segment against a memory and is never materialised: the report has no ESS."""
        _, hidden = self(tokens, mask)
        return {"hidden": hidden[None]}

    def _windowed(self, tokens, mask):
        x, bias = self._embed(tokens), self._bias(mask)
        for block in [*self.local_blocks, *self.global_blocks]:
            x = block(x, bias, window=(self.config.segment - 1, 0))[0]
        hidden = self.final_norm(x)
        return self.decoder(hidden), hidden

    # ---- streaming -------------------------------------------------------------------

    def stream(self, chunks: Iterable, state: FoldedStreamState | None = None) -> Iterator[torch.Tensor]:
        """Yield next-token logits ``[B, m, vocab]`` per segment (m = l; the last may be
        shorter) for ``chunks``: ``[B, k]`` token tensors or ``(tokens, mask)`` pairs of
        any k. Equal to ``self(all tokens)[0]`` cut into segments, over calls that share a
        ``state`` too (a call that ends on a partial segment keeps it pending; the next
        yields only its new positions)."""
        if not self.config.folded:
            raise ValueError("stream needs the folded model (config key 'folded' = true)")
        state = check_state(state, FoldedStreamState)
        vocab_size, device = self.config.vocab_size, self.embedding.weight.device
        segments = segment_stream(
            chunks, self.config.segment, state, lambda ids: check_token_inputs(ids, None, vocab_size, device=device)[0]
        )
        for tokens, mask, yielded in segments:
            yield self.push_segment(tokens, mask, state, yielded)

    def push_segment(self, tokens, mask, state: FoldedStreamState, yielded: int = 0) -> torch.Tensor:
        """One segment (at most l tokens) against the memory in ``state``; updates it. Its
        first ``yielded`` positions (already returned for a partial segment) are left out."""
        l, state = self.config.segment, check_state(state, FoldedStreamState, fresh=False)
        tokens, mask = check_segment(tokens, mask, yielded, self.config.vocab_size, self.embedding.weight.device)
        if tokens.shape[1] > l:
            raise ValueError(f"a segment has at most segment={l} tokens, got {tokens.shape[1]}")
        if state.memory is not None and tokens.shape[0] != state.memory.shape[0]:
            raise ValueError(f"every chunk needs batch size {state.memory.shape[0]}, got {tokens.shape[0]}")
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):  # as forward: padding last
            before = mask.new_ones(mask.shape[0], 1) if state.memory_mask is None else state.memory_mask[:, -1:]
            joined = torch.cat([before, mask], 1)
            refuse_unless(
                ~(joined[:, 1:] & ~joined[:, :-1]).any(),
                "FoldedContext needs each row's padding at its end, across the chunks of a stream too",
            )
        local = self._local(self._embed(tokens), mask)
        memory, memory_mask = self._empty_memory(local) if state.memory is None else (state.memory, state.memory_mask)
        out = self._fold(local, mask, memory, memory_mask)
        if tokens.shape[1] == l:
            state.memory, state.memory_mask = out, mask
        state.position += tokens.shape[1] - yielded
        return self.decoder(self.final_norm(out[:, yielded:]))
