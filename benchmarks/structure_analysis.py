"""What the structure study (benchmarks/structure.py) measures: what the gold trees allow
(the share of gold heads at each offset, the ceiling of a topology reaching distance k or
ROOT), a context-free unigram's masked perplexity on the trainer's validation masks, where
each channel's argmax heads go, and ACT's per-token iterations by UPOS tag and by training
frequency of the word."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from benchmarks.structure_runs import CONFIGS

FREQUENCY_BUCKETS = [(0, 0), (1, 9), (10, 99), (100, 999), (1000, 10**9)]  # training counts of the word


def gold_offsets(trees) -> dict:
    """What the gold trees allow: the share of words whose head is ROOT, the previous word,
    the next word, and the ceiling of a topology reaching only distance <= k (or ROOT)."""
    words = root = previous = following = last_to_previous = last_to_root = 0
    within = Counter()
    for tree in trees:
        for position, head in enumerate(tree.heads, start=1):
            words += 1
            root += head == 0
            previous += head == position - 1 and head > 0
            following += head == position + 1
            if head > 0:
                within[abs(head - position)] += 1
        if tree.heads:  # the last word has no next word: the positional rules' fallbacks
            last = len(tree.heads)
            # (a one-word sentence's only head is ROOT)
            last_to_previous += tree.heads[-1] == (last - 1 if last > 1 else 0)
            last_to_root += tree.heads[-1] == 0
    ceiling = {f"window({k}) | root()": (root + sum(within[d] for d in range(1, k + 1))) / words for k in (1, 2, 3)}
    return {
        "words": words,
        "root": root / words,
        "previous_word": previous / words,
        "next_word": following / words,
        "adjacent_either_side": (previous + following) / words,
        # positional rules, no learning: every word's head is the next word, and the last
        # word's (which has none) the previous word (ROOT in a one-word sentence), or ROOT. A
        # window(k) topology without a root arc for the last word leaves it only leftward heads:
        # the first rule is what such a model's "next word" channel scores, so it is the
        # baseline a learned channel must beat
        "next_else_previous": (following + last_to_previous) / words,
        "next_else_root": (following + last_to_root) / words,
        "ceiling": ceiling,
    }


@torch.no_grad()
def unigram_mlm(run: Path) -> dict:
    """Masked perplexity of a context-free model on exactly the trainer's validation masks
    (``evaluate_model``, fixed mask seed): every masked word predicted by its training
    unigram frequency (add-one). What an MLM at this budget must beat to use context."""
    from probformer.training import run_config
    from probformer.training.corpus import prepare_corpus
    from probformer.training.evaluate import load_any
    from probformer.training.validation import evaluate_model

    _, vocabulary = load_any(run)
    config = run_config.load(CONFIGS / "mlm-full-root.toml")
    corpus = prepare_corpus(config.data, vocabulary)
    counts = torch.ones(len(vocabulary))
    for ids, _ in corpus.train:
        counts += torch.bincount(torch.tensor(ids), minlength=len(vocabulary))

    class Unigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.log_probabilities = torch.nn.Parameter((counts / counts.sum()).log())

        def forward(self, tokens, mask):
            return self.log_probabilities.expand(*tokens.shape, -1), None

    return evaluate_model(Unigram(), corpus.valid, "mlm", len(vocabulary))


@torch.no_grad()
def head_destinations(model, vocabulary, trees, batch_size: int = 32) -> dict:
    """Per channel, where the argmax head of each word goes: ROOT, another virtual node (a
    Star relay), the previous word, the next word, farther (shares of the words). The UAS
    itself is ``evaluate --task uas``'s (which counts only the ROOT node as root; rows
    written before that fix carry their own ``uas_root_only``)."""
    model.eval()
    virtual = model.crf.topology.virtual
    root = virtual.index("root") if "root" in virtual else None
    kinds_names = ("root", "other_virtual", "previous_word", "next_word", "farther")
    counts = torch.zeros(model.crf.channels, len(kinds_names))
    for start in range(0, len(trees), batch_size):
        chunk = trees[start : start + batch_size]
        n = max(len(t.words) for t in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        gold = torch.full((len(chunk), n), -1, dtype=torch.long)
        for row, tree in enumerate(chunk):
            tokens[row, : len(tree.words)] = torch.tensor(vocabulary.encode(tree.words))
            gold[row, : len(tree.words)] = torch.tensor(tree.heads)
        mask = gold >= 0
        choice = model(tokens, mask)[1].h[:, :, :n, :].argmax(-1)  # [B, C, n], node index
        offset = choice - torch.arange(n)
        to_root = choice == (n + root if root is not None else -1)
        token = choice < n  # choice = i + 1 may be the first virtual node at the batch's last position
        kinds = [to_root, ~token & ~to_root, offset == -1, token & (offset == 1), token & (offset.abs() > 1)]
        counts += (torch.stack(kinds, -1) & mask[:, None, :, None]).sum((0, 2)).float()
    shares = counts / counts.sum(-1, keepdim=True)
    return {"per_channel": [dict(zip(kinds_names, row.tolist())) for row in shares]}


@torch.no_grad()
def depth_by_token(model, vocabulary, trees, train_counts: Counter, batch_size: int = 32) -> dict:
    """ACT's per-token iterations N(t) on ``trees``: spread, and means by UPOS tag and by
    the word's training frequency."""
    model.eval()
    updates, ponder, first, tags, frequencies = [], [], [], [], []
    for start in range(0, len(trees), batch_size):
        chunk = trees[start : start + batch_size]
        n = max(len(t.words) for t in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.bool)
        for row, tree in enumerate(chunk):
            tokens[row, : len(tree.words)] = torch.tensor(vocabulary.encode(tree.words))
            mask[row, : len(tree.words)] = True
            tags.extend(tree.upos)
            frequencies.extend(train_counts[w] for w in tree.words)
        halting = model(tokens, mask)[1].halting
        updates.append(halting["updates"][:, :n][mask])
        ponder.append(halting["ponder"][:, :n][mask])
        first.append(halting["weights"][0][:, :n][mask])  # w_1: p_1, or 1 where a token halts at once
    steps, ponder, first = torch.cat(updates), torch.cat(ponder), torch.cat(first)
    mode = int(steps.mode().values)
    by_tag = {}
    for tag in sorted(set(tags)):
        chosen = torch.tensor([t == tag for t in tags])
        by_tag[tag] = {
            "words": int(chosen.sum()),
            "iterations": float(steps[chosen].mean()),
            "ponder": float(ponder[chosen].mean()),
        }
    by_frequency = {}
    frequency = torch.tensor(frequencies)
    for low, high in FREQUENCY_BUCKETS:
        chosen = (frequency >= low) & (frequency <= high)
        if chosen.any():
            name = f"{low}-{high}" if high < 10**9 else f">={low}"
            by_frequency[name] = {
                "words": int(chosen.sum()),
                "iterations": float(steps[chosen].mean()),
                "ponder": float(ponder[chosen].mean()),
            }
    return {
        "words": int(steps.numel()),
        "iterations_mean": float(steps.mean()),
        "iterations_sd": float(steps.std()),
        "iterations_min": float(steps.min()),
        "iterations_max": float(steps.max()),
        "iterations_mode": mode,
        "share_not_at_mode": float((steps != mode).float().mean()),
        "ponder_mean": float(ponder.mean()),
        "ponder_sd": float(ponder.std()),
        "first_weight_mean": float(first.mean()),
        "first_weight_sd": float(first.std()),
        "first_weight_min": float(first.min()),
        "first_weight_max": float(first.max()),
        # the share of the variance of N(t) between UPOS tags (correlation ratio eta^2; 0 when N is constant)
        "eta_squared_upos": _between_share(steps, tags),
        "ponder_eta_squared_upos": _between_share(ponder, tags),
        "by_upos": by_tag,
        "by_train_frequency": by_frequency,
    }


def _between_share(values: torch.Tensor, groups: list[str]) -> float:
    total = float(((values - values.mean()) ** 2).sum())
    if total == 0:
        return 0.0
    between = 0.0
    for group in set(groups):
        chosen = torch.tensor([g == group for g in groups])
        between += int(chosen.sum()) * float(values[chosen].mean() - values.mean()) ** 2
    return between / total
