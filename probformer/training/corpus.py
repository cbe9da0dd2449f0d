"""The corpus of a training run: read and encode the configured data source (PTB, UD
EWT, text or a Hugging Face dataset with a trained WordPiece tokenizer), validate lengths
and tags, and cut deterministic, length-bucketed batches (a function of seed and epoch).

A sentence longer than ``data.max_length`` is never dropped: with
``data.long_sentences = "error"`` (the default) the run stops before training, naming how
many there are; with ``"windows"`` it is cut into consecutive windows of at most
``max_length`` tokens (tags cut alongside), each an example, and ``Corpus.windowed``
counts the sentences cut, per split."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from probformer.training import data, run_config

__all__ = ["Corpus", "prepare_corpus", "windows", "epoch_order", "collate", "inputs_and_targets", "IGNORE"]

IGNORE = -100


@dataclass
class Corpus:
    vocabulary: data.Vocabulary | data.SubwordVocabulary
    train: list[tuple[list[int], list[int] | None]]  # token ids, tag ids (pos) or None
    valid: list[tuple[list[int], list[int] | None]]
    tags: list[str] | None = None  # UPOS tag names for the pos task
    valid_heads: list[list[int]] | None = None  # gold heads of the validation sentences (ewt; whole, not windows)
    windowed: dict[str, int] = field(default_factory=dict)  # sentences cut into windows: {"training": n, ...}


@dataclass
class _Split:
    words: list[list[str]]
    tags: list[list[str]] | None = None  # UPOS tags (ewt)
    heads: list[list[int]] | None = None  # gold heads (ewt)

    def first(self, count: int) -> _Split:
        """The first ``count`` sentences (all when 0)."""
        if not count:
            return self
        return _Split(self.words[:count], self.tags and self.tags[:count], self.heads and self.heads[:count])


def prepare_corpus(config: run_config.DataConfig, vocabulary=None, tags=None) -> Corpus:
    """Read, split and encode the data of ``config``; ``vocabulary`` (and ``tags``) from
    a checkpoint replace the ones built from the training data."""
    train, valid, subword_lines = _read_splits(config.source)
    train, valid = train.first(config.train_sentences), valid.first(config.valid_sentences)
    if not train.words or not valid.words:
        raise ValueError(f"data.source {config.source!r} gave an empty training or validation set")
    if vocabulary is None and subword_lines is not None:
        vocabulary = data.SubwordVocabulary.train(subword_lines, config.vocabulary)
    if vocabulary is None:
        vocabulary = data.Vocabulary.build(train.words, max_size=config.vocabulary)
    if len(vocabulary) <= len(data.SPECIALS):
        # nothing to learn, and masking draws its random words from the ordinary tokens
        raise ValueError(
            f"data.source {config.source!r}: the vocabulary has no token besides {list(data.SPECIALS)} (the "
            "training text gives no word or piece the tokenizer keeps); train on text with words in it"
        )
    if config.task == "pos":
        tags = tags or sorted({t for sentence in train.tags for t in sentence})
    tag_index = {t: i for i, t in enumerate(tags or [])}
    windowed = {}
    encoded = {}
    for name, split in (("training", train), ("validation", valid)):
        encoded[name], windowed[name] = _encode(split, name, config, vocabulary, tag_index)
        if not encoded[name]:  # lines that are not blank (zero-width or control characters) but give no token
            raise ValueError(
                f"data.source {config.source!r}: none of the {len(split.words)} {name} sentences gives a token "
                "(the tokenizer keeps nothing of them, e.g. zero-width or control characters); a run needs "
                "training and validation sentences with words in them"
            )
    corpus = Corpus(vocabulary, encoded["training"], encoded["validation"])
    corpus.tags, corpus.valid_heads, corpus.windowed = tags, valid.heads, windowed
    return corpus


def _read_splits(source: str) -> tuple[_Split, _Split, list[str] | None]:
    """The training and validation splits of ``source``, and the training lines a subword
    tokenizer learns from (None for PTB and EWT, which come split into words)."""
    if source == "ptb":
        return _Split(data.ptb_sentences("train")), _Split(data.ptb_sentences("valid")), None
    if source == "ewt":
        train, valid = data.read_conllu(data.ewt_path("train")), data.read_conllu(data.ewt_path("dev"))
        return (
            _Split([s.words for s in train], [s.upos for s in train]),
            _Split([s.words for s in valid], [s.upos for s in valid], [s.heads for s in valid]),
            None,
        )
    splits = data.text_splits(source)  # a text file or folder, or a Hugging Face dataset (hf:...)
    words = {name: [line.split() for line in lines] for name, lines in splits.items()}
    return _Split(words["train"]), _Split(words["valid"]), splits["train"]


def _encode(split: _Split, name: str, config, vocabulary, tag_index: dict) -> tuple[list, int]:
    """``(examples, sentences cut into windows)`` of one split; a sentence longer than
    ``data.max_length`` stops the run unless ``data.long_sentences = "windows"``."""
    examples, too_long = [], []
    for number, sentence in enumerate(split.words):
        ids = vocabulary.encode(sentence)
        if not ids:  # a line the tokenizer reduces to nothing: no token to learn from
            continue
        labels = None
        if config.task == "pos":
            unknown = set(split.tags[number]) - set(tag_index)
            if unknown:
                raise ValueError(f"{name} sentence #{number} has tags {sorted(unknown)} unseen in training")
            labels = [tag_index[t] for t in split.tags[number]]
        if len(ids) > config.max_length:
            too_long.append(len(ids))
        examples += windows(ids, labels, config.max_length, config.task)
    if too_long and config.long_sentences == "error":
        raise ValueError(
            f"{len(too_long)} {name} sentences are longer than data.max_length={config.max_length} "
            f'(longest: {max(too_long)}); raise data.max_length, or set data.long_sentences = "windows" '
            "to cut them into windows"
        )
    return examples, len(too_long)


def windows(ids: list[int], labels: list[int] | None, max_length: int, task: str = "mlm") -> list[tuple]:
    """``(ids, labels)`` cut into windows of at most ``max_length`` tokens (one example when
    it fits), with the context of its window: consecutive, every token once; for next-token
    prediction ("lm") each window starts on the last token of the one before, so that every
    token but the sentence's first is a target once (a window's first token has no target)."""
    overlap = 1 if task == "lm" else 0
    if overlap and max_length < 2:
        raise ValueError(f"next-token windows need data.max_length >= 2 (a target after its token), got {max_length}")
    return [
        (ids[start : start + max_length], None if labels is None else labels[start : start + max_length])
        for start in range(0, max(len(ids) - overlap, 1), max_length - overlap)
    ]


def epoch_order(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of example indices for one epoch: shuffled, then bucketed by length within
    pools of 50 batches (less padding), batch order shuffled; a function of (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    pool = 50 * batch_size
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    shuffled = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffled]


def collate(examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens [B, n]``, ``mask [B, n]``, ``labels [B, n]`` (-100 on padding / no tags)."""
    n = max(len(ids) for ids, _ in examples)
    tokens = torch.zeros(len(examples), n, dtype=torch.long)
    labels = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    for row, (ids, tags) in enumerate(examples):
        tokens[row, : len(ids)] = torch.tensor(ids)
        if tags is not None:
            labels[row, : len(tags)] = torch.tensor(tags)
    return tokens, tokens != 0, labels


def inputs_and_targets(task, tokens, mask, labels, vocab_size, rate, generator):
    if task == "pos":
        return tokens, labels
    if task == "lm":  # position i predicts token i + 1 (a causal model)
        targets = torch.full_like(tokens, IGNORE)
        targets[:, :-1] = tokens[:, 1:].masked_fill(~mask[:, 1:], IGNORE)
        return tokens, targets
    return data.mask_tokens(tokens, mask, vocab_size, rate=rate, generator=generator)
