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


def prepare_corpus(config: run_config.DataConfig, vocabulary=None, tags=None) -> Corpus:
    """Read, split and encode the data of ``config``; ``vocabulary`` (and ``tags``) from
    a checkpoint replace the ones built from the training data."""
    heads = None
    if config.source == "ptb":
        train_words = data.ptb_sentences("train")
        valid_words = data.ptb_sentences("valid")
        train_tags = valid_tags = None
    elif config.source == "ewt":
        train_trees = data.read_conllu(data.ewt_path("train"))
        valid_trees = data.read_conllu(data.ewt_path("dev"))
        train_words, valid_words = [s.words for s in train_trees], [s.words for s in valid_trees]
        train_tags, valid_tags = [s.upos for s in train_trees], [s.upos for s in valid_trees]
        heads = [s.heads for s in valid_trees]
    else:  # a text file or folder, or a Hugging Face dataset (hf:...)
        splits = data.text_splits(config.source)
        train_words = [line.split() for line in splits["train"]]
        valid_words = [line.split() for line in splits["valid"]]
        train_tags = valid_tags = None
        if vocabulary is None:
            vocabulary = data.SubwordVocabulary.train(splits["train"], config.vocabulary)
    if config.train_sentences:
        train_words = train_words[: config.train_sentences]
        train_tags = train_tags and train_tags[: config.train_sentences]
    if config.valid_sentences:
        valid_words = valid_words[: config.valid_sentences]
        valid_tags = valid_tags and valid_tags[: config.valid_sentences]
        heads = heads and heads[: config.valid_sentences]
    if not train_words or not valid_words:
        raise ValueError(f"data.source {config.source!r} gave an empty training or validation set")
    if vocabulary is None:
        vocabulary = data.Vocabulary.build(train_words, max_size=config.vocabulary)
    if config.task == "pos":
        tags = tags or sorted({t for sentence in train_tags for t in sentence})
    tag_index = {t: i for i, t in enumerate(tags or [])}

    windowed = {}

    def encode(words, sentence_tags, split):
        examples, too_long = [], []
        for number, sentence in enumerate(words):
            ids = vocabulary.encode(sentence)
            if not ids:  # a line the tokenizer reduces to nothing: no token to learn from
                continue
            labels = None
            if config.task == "pos":
                unknown = set(sentence_tags[number]) - set(tag_index)
                if unknown:
                    raise ValueError(f"{split} sentence #{number} has tags {sorted(unknown)} unseen in training")
                labels = [tag_index[t] for t in sentence_tags[number]]
            if len(ids) > config.max_length:
                too_long.append(len(ids))
            examples += windows(ids, labels, config.max_length)
        if too_long and config.long_sentences == "error":
            raise ValueError(
                f"{len(too_long)} {split} sentences are longer than data.max_length={config.max_length} "
                f'(longest: {max(too_long)}); raise data.max_length, or set data.long_sentences = "windows" '
                "to cut them into windows"
            )
        windowed[split] = len(too_long)
        return examples

    corpus = Corpus(
        vocabulary, encode(train_words, train_tags, "training"), encode(valid_words, valid_tags, "validation")
    )
    corpus.tags, corpus.valid_heads, corpus.windowed = tags, heads, windowed
    return corpus


def windows(ids: list[int], labels: list[int] | None, max_length: int) -> list[tuple[list[int], list[int] | None]]:
    """``(ids, labels)`` cut into consecutive windows of at most ``max_length`` tokens (one
    example when it fits): every token stays, once, with the context of its window."""
    return [
        (ids[start : start + max_length], None if labels is None else labels[start : start + max_length])
        for start in range(0, len(ids), max_length)
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
