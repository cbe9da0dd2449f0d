"""``probformer evaluate CHECKPOINT --task mlm|pos|uas``: the metric table of a trained model.

- mlm: masked-token loss and perplexity (fixed 15% BERT masks) on PTB or EWT or a text file;
- pos: UPOS accuracy of a tagging model on EWT;
- uas: do the PT's head posteriors agree with syntax? For every channel, the argmax
  head of each word is compared with the gold UD head (a head on the ROOT node counts
  as "root"); reported per channel, best channel and mean, beside the trivial
  left-/right-neighbour baselines.
"""

from __future__ import annotations

from pathlib import Path

import torch

from probformer.training import checkpoint, data
from probformer.training.corpus import IGNORE
from probformer.training.trainer import evaluate_model, latest_checkpoint

__all__ = ["load_any", "evaluate", "attachment_scores", "TASKS"]

TASKS = ("mlm", "pos", "uas")


def load_any(path):
    """A model and vocabulary from a checkpoint folder or a training-run folder (its
    ``model`` folder, else its latest checkpoint)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return checkpoint.load(path)
    if (path / "model" / "config.json").is_file():
        return checkpoint.load(path / "model")
    if (path / "checkpoints" / "latest").is_file():
        return checkpoint.load(latest_checkpoint(path))
    raise FileNotFoundError(f"{path} is neither a checkpoint nor a training-run folder")


def _examples(sentences, vocabulary, max_length, tags=None):
    tag_index = {t: i for i, t in enumerate(tags or [])}
    examples = []
    for sentence in sentences:
        words = sentence.words if isinstance(sentence, data.TreebankSentence) else sentence
        ids = vocabulary.encode(words)
        if not ids or len(ids) > max_length:
            continue
        labels = [tag_index.get(t, IGNORE) for t in sentence.upos] if tags else None
        examples.append((ids, labels))
    return examples


@torch.no_grad()
def attachment_scores(model, vocabulary, sentences: list[data.TreebankSentence], batch_size: int = 32) -> dict:
    """Unlabelled attachment of the argmax head per channel against gold heads."""
    if not hasattr(model, "mean_field"):
        raise ValueError(f"--task uas needs a Probabilistic Transformer (head variables), got {type(model).__name__}")
    if isinstance(vocabulary, data.SubwordVocabulary):
        raise ValueError("--task uas needs a word-level vocabulary: subword tokens do not align with UD words")
    model.eval()
    root_node = "root()" in model.crf.topology.name
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
        choice = heads[:, :, :n, :].argmax(-1)  # [B, C, n], node index
        # node j < n is word j + 1; the first virtual node is ROOT when the topology has one
        predicted = torch.where(choice < n, choice + 1, 0 if root_node else -2)
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


def evaluate(path, task: str, source: str | None = None, split: str = "valid", sentences: int = 0) -> dict:
    if task not in TASKS:
        raise ValueError(f"--task must be one of {list(TASKS)}, got {task!r}")
    if split not in ("valid", "test"):
        raise ValueError(f"--split must be 'valid' or 'test', got {split!r}")
    model, vocabulary = load_any(path)
    if vocabulary is None:
        raise ValueError(f"{path} has no vocabulary: cannot encode evaluation text")
    source = source or ("ptb" if task == "mlm" else "ewt")
    max_length = getattr(model.config, "max_length", 10_000)
    if source == "ewt":
        trees = data.read_conllu(data.ewt_path("dev" if split == "valid" else "test"))
    elif task != "mlm":
        raise ValueError(f"--task {task} needs --data ewt (gold tags and heads)")
    elif source == "ptb":
        trees = data.ptb_sentences(split)
    else:
        trees = [line.split() for line in data.text_lines(source)]
    trees = trees[:sentences] if sentences else trees
    if task == "uas":
        return attachment_scores(model, vocabulary, [t for t in trees if len(t.words) <= max_length])
    if task == "pos":
        if model.config.task != "tagging":
            raise ValueError(f"--task pos needs a tagging model, got task {model.config.task!r}")
        tags = _checkpoint_tags(path)
        examples = _examples(trees, vocabulary, max_length, tags)
        return evaluate_model(model, examples, "pos", len(vocabulary))
    if model.config.task != "mlm":
        raise ValueError(f"--task mlm needs an MLM model, got task {model.config.task!r}")
    return evaluate_model(model, _examples(trees, vocabulary, max_length), "mlm", len(vocabulary))


def _checkpoint_tags(path) -> list[str]:
    import json

    path = Path(path)
    for candidate in (path / "tags.json", path / "model" / "tags.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    if (path / "checkpoints" / "latest").is_file():
        return json.loads((latest_checkpoint(path) / "training.json").read_text())["tags"]
    raise FileNotFoundError(f"{path} records no tag set (tags.json): was it trained with data.task='pos'?")


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
        return
    for key, value in metrics.items():
        print(f"  {key:12s} {value:.4f}" if isinstance(value, float) else f"  {key:12s} {value}")
