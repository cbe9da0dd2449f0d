"""``probformer evaluate MODEL --task mlm|lm|pos|uas``: the metric table of a trained model.

- mlm: masked-token loss and perplexity (fixed 15% BERT masks) on PTB or EWT or a text file;
- lm: next-token loss and perplexity of a causal model (FoldedContext), same data;
- pos: UPOS accuracy of a tagging model on EWT;
- uas: do the PT's head posteriors agree with syntax? For every channel, the argmax
  head of each word is compared with the gold UD head (a head on the ROOT node counts
  as "root"); reported per channel, best channel and mean, beside the trivial
  left-/right-neighbour baselines.

Splits (``read_split``): PTB has train/valid/test, EWT train/valid (its dev file)/test,
an ``hf:`` dataset its own. A plain-text file or folder has the trainer's split: its last
5% of lines (at least one) are ``valid``, the rest ``train``; ``all`` is every line (a
separate test file); it has no ``test`` split of its own.

Sentences longer than the model's ``max_length`` are never dropped: for mlm, lm and pos they
are cut into consecutive windows of at most ``max_length`` tokens, each token scored
once (``windowed`` in the metrics counts them); uas cannot cut a tree, so those
sentences are left out and counted (``skipped_too_long``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from probformer.models import pretrained
from probformer.training import checkpoint, data
from probformer.training.corpus import windows
from probformer.training.run_config import DataConfig
from probformer.training.validation import evaluate_model

__all__ = [
    "load_any",
    "evaluate",
    "attachment_scores",
    "read_split",
    "encode_windows",
    "trained_max_length",
    "TASKS",
    "SPLITS",
]

TASKS = ("mlm", "lm", "pos", "uas")
SPLITS = ("train", "valid", "test", "all")


def load_any(path):
    """A model and vocabulary from any model folder (a checkpoint, a run's ``model/``, a
    torch export) or a training-run folder (its ``model`` folder, else its latest
    checkpoint)."""
    path = Path(path)
    if not (path / "config.json").is_file() and pretrained.model_folder(path) == path:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint, a model or torch-export folder nor a training-run folder"
        )
    return checkpoint.load(path)


def read_split(source: str, split: str | None = None) -> tuple[list, str]:
    """The sentences of ``split`` of a data source and the split's name: PTB and EWT
    (``TreebankSentence``, with tags and heads) by their own splits; a text file or folder
    or ``hf:...`` (lists of words) by the trainer's splits (``data.text_splits``: a Hugging
    Face dataset's own, else the last 5% of lines validate), ``all`` every line.
    ``split=None`` is ``valid`` for PTB, EWT and ``hf:``, ``all`` for a text file or folder."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"--split must be one of {list(SPLITS)}, got {split!r}")
    if source in ("ptb", "ewt"):
        split = split or "valid"
        if split == "all":
            raise ValueError(f"--split all is for a text file or folder; --data {source} has train, valid and test")
        if source == "ptb":
            return data.ptb_sentences(split), split
        return data.read_conllu(data.ewt_path("dev" if split == "valid" else split)), split
    split = split or ("valid" if source.startswith("hf:") else "all")
    if split == "all":
        return [line.split() for line in data.text_lines(source)], split
    splits = data.text_splits(source)
    if split not in splits:
        raise ValueError(
            f"--data {source} has no {split} split (a text file or folder has train and valid = its last 5% of "
            f"lines, as in training, and all); pass the {split} text as its own file with --split all"
        )
    return [line.split() for line in splits[split]], split


def encode_windows(sentences, vocabulary, max_length, tags=None, task: str = "mlm") -> tuple[list, int]:
    """``(ids, labels)`` examples, a long sentence as several windows; and how many
    sentences were cut."""
    tag_index = {t: i for i, t in enumerate(tags or [])}
    if tags:  # a tag the model has no output for could only be left out of the accuracy: refused
        unseen = sorted({t for sentence in sentences for t in sentence.upos} - set(tag_index))
        if unseen:
            raise ValueError(
                f"the evaluation data has tags the model was not trained on: {unseen} (it knows {list(tags)}); "
                "their words could not be scored"
            )
    examples, windowed = [], 0
    for sentence in sentences:
        words = sentence.words if isinstance(sentence, data.TreebankSentence) else sentence
        ids = vocabulary.encode(words)
        if not ids:
            continue
        labels = [tag_index[t] for t in sentence.upos] if tags else None
        windowed += len(ids) > max_length
        examples.extend(windows(ids, labels, max_length, task))
    return examples, windowed


@torch.no_grad()
def attachment_scores(model, vocabulary, sentences: list[data.TreebankSentence], batch_size: int = 32) -> dict:
    """Unlabelled attachment of the argmax head per channel against gold heads."""
    if not hasattr(model, "mean_field"):
        raise ValueError(f"--task uas needs a Probabilistic Transformer (head variables), got {type(model).__name__}")
    if isinstance(vocabulary, data.SubwordVocabulary):
        raise ValueError("--task uas needs a word-level vocabulary: subword tokens do not align with UD words")
    model.eval()
    virtual = model.crf.topology.virtual
    root_node = "root" in virtual
    # the ROOT node's offset among the virtual nodes (a Star relay may come first)
    root_offset = virtual.index("root") if root_node else -1
    correct = torch.zeros(model.crf.channels)
    left = right = total = 0
    for start in range(0, len(sentences), batch_size):
        chunk = sentences[start : start + batch_size]
        n = max(len(s.words) for s in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        gold = torch.full((len(chunk), n), -1, dtype=torch.long)
        for row, s in enumerate(chunk):
            tokens[row, : len(s.words)] = torch.tensor(vocabulary.encode(s.words))
            gold[row, : len(s.words)] = torch.tensor(s.heads)
        mask = gold >= 0
        heads = model(tokens, mask)[1].h  # [B, C, N, N]
        rows = heads[:, :, :n, :]
        choice = rows.argmax(-1)  # [B, C, n], node index
        # node j < n is word j + 1; node n + root_offset is ROOT; any other virtual node (a relay,
        # a cluster) is no word of the tree, and a word with no legal head (a row of zeros, whose
        # argmax is node 0) has no prediction: neither ever counts as a hit (-2)
        predicted = torch.where(choice < n, choice + 1, torch.where(choice == n + root_offset, 0, -2))
        predicted = torch.where(rows.amax(-1) > 0, predicted, -2)
        hits = (predicted == gold[:, None]) & mask[:, None]
        correct += hits.sum((0, 2)).float()
        position = torch.arange(1, n + 1)
        left += int(((gold == position - 1) & mask & (position > 1)).sum())
        right += int(((gold == position + 1) & mask).sum())
        total += int(mask.sum())
    per_channel = (correct / max(total, 1)).tolist()
    return {
        "words": total,
        "per_channel": per_channel,
        "best_channel": max(per_channel),
        "mean": sum(per_channel) / len(per_channel),
        "left_neighbour_baseline": left / max(total, 1),
        "right_neighbour_baseline": right / max(total, 1),
        "root_node": root_node,
    }


def evaluate(path, task: str, source: str | None = None, split: str | None = None, sentences: int = 0) -> dict:
    """The metrics of the model at ``path`` (a checkpoint or run folder) on the first
    ``sentences`` sentences (0: all) of ``split`` of ``source`` (default: ptb for mlm,
    ewt for pos and uas; see ``read_split``)."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {list(TASKS)}, got {task!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"--split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(sentences, bool) or not isinstance(sentences, int) or sentences < 0:
        raise ValueError(f"--sentences must be an integer >= 0, got {sentences!r}")
    source = source or ("ptb" if task in ("mlm", "lm") else "ewt")
    if task in ("pos", "uas") and source != "ewt":
        raise ValueError(f"--task {task} needs --data ewt (gold tags and heads)")
    model, vocabulary = load_any(path)
    if vocabulary is None:
        raise ValueError(f"{path} has no vocabulary: cannot encode evaluation text")
    trees, split = read_split(source, split)
    trees = trees[:sentences] if sentences else trees
    model_limit = getattr(model.config, "max_length", None) or 10**9  # the PT has no length limit
    if task == "uas":  # whole trees, which windows would cut: only what the model cannot read is left out
        fits = [t for t in trees if len(t.words) <= model_limit]
        return {**attachment_scores(model, vocabulary, fits), "skipped_too_long": len(trees) - len(fits)}
    learned = getattr(model.config, "task", "lm")  # the causal models have no task key: they learn "lm"
    needed = {"pos": "tagging", "mlm": "mlm", "lm": "lm"}[task]
    if learned != needed:
        raise ValueError(
            f"--task {task} needs a model trained for {needed!r}, got {type(model).__name__} ({learned!r})"
        )
    tags = _checkpoint_tags(path, model.config.num_classes) if task == "pos" else None
    max_length = trained_max_length(path) or model_limit  # the windows the run validated on
    examples, windowed = encode_windows(trees, vocabulary, max_length, tags, task)
    if not examples:
        raise ValueError(f"--data {source} --split {split} holds no sentences to evaluate")
    mask_rate = _trained_mask_rate(path)
    metrics = evaluate_model(model, examples, task, len(vocabulary), mask_rate)
    extra = {"mask_rate": mask_rate} if task == "mlm" else {}
    return {**metrics, **extra, "sentences": len(trees), "windowed": windowed}


def _trained_mask_rate(path) -> float:
    """The masking rate the run trained with (``_trained_data``), else the default's: a
    perplexity read at another rate is another number."""
    return _trained_data(path, "mask_rate", float, DataConfig().mask_rate)


def trained_max_length(path) -> int | None:
    """The window length the run validated with (its ``data.max_length``: the trainer cuts a
    longer sentence there), else None: an evaluation cut elsewhere scores other examples."""
    return _trained_data(path, "max_length", int, None)


def _trained_data(path, key: str, kind, default):
    """``data.<key>`` of the run the model at ``path`` came from (its run.json: a run folder,
    its model folder or one of its checkpoints), else ``default``. The path is resolved
    first: a relative ``step-0000004`` read from a run's ``checkpoints/`` has no parents to
    find the run by."""
    path = Path(path).resolve()
    for record in (folder / "run.json" for folder in (path, path.parent, path.parent.parent)):
        if record.is_file():
            try:
                value = json.loads(record.read_text())["data"][key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(value)
                return kind(value)
            except (ValueError, KeyError, TypeError):  # not silently the default: this run said otherwise
                raise ValueError(f"{record} records no readable data.{key}") from None
    return default


def _checkpoint_tags(path, num_classes: int) -> list[str]:
    tags = checkpoint.load_tags(path, num_classes)
    if tags is None:
        raise FileNotFoundError(f"{path} records no tag set (tags.json): was it trained with data.task='pos'?")
    return tags


def print_table(task: str, metrics: dict) -> None:
    if task == "uas":
        print(f"UAS of argmax heads on {metrics['words']} words (ROOT node: {metrics['root_node']})")
        for channel, value in enumerate(metrics["per_channel"]):
            print(f"  channel {channel:2d}   {value:.4f}")
        print(f"  best channel {metrics['best_channel']:.4f}   mean {metrics['mean']:.4f}")
        print(
            f"  baselines: left neighbour {metrics['left_neighbour_baseline']:.4f}, "
            f"right neighbour {metrics['right_neighbour_baseline']:.4f}"
        )
        if metrics.get("skipped_too_long"):
            print(f"  left out: {metrics['skipped_too_long']} sentences longer than the model's max_length")
        return
    for key, value in metrics.items():
        note = "  (sentences longer than the model's max_length, scored in windows)" if key == "windowed" else ""
        print(f"  {key:12s} {value:.4f}" if isinstance(value, float) else f"  {key:12s} {value}{note}")
