"""A linear-chain CRF POS tagger on UD English-EWT, trained, exported and reloaded
(docs/factors.md, "Worked example: a tagger").

The model is a Probabilistic Transformer (mean-field inference in a CRF over latent
labels, docs/concepts.md) with one more factor template, declared as data:
PTConfig(pairwise="chain()") adds graphs.factors.Pairwise on the chain topology, a
transition table between the labels of neighbouring words (a linear-chain CRF). Being
data, it is saved, loaded and exported with no code.

    python examples/pos_tagger.py                  # ~3 minutes on 1 CPU thread
    python examples/pos_tagger.py --pairwise ""    # the same budget without the chain factor
    python examples/pos_tagger.py --quick          # a few steps on a few sentences (a smoke run)

The data is UD English-EWT (CC BY-SA 4.0): `probformer data fetch ud-ewt`, or
$PROBFORMER_EWT naming a folder with en_ewt-ud-{train,dev}.conllu.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from probformer.deploy import exporter, load
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig
from probformer.training import data
from probformer.training.corpus import IGNORE, collate, epoch_order

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--pairwise", default="chain()", help='the Pairwise factor\'s topology ("": none)')
parser.add_argument("--steps", type=int, default=1500, help="optimiser steps (about 4 epochs)")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--train-sentences", type=int, default=0, help="use the first N (0: all 12,544)")
parser.add_argument("--dev-sentences", type=int, default=0, help="score the first N (0: all 2,001)")
parser.add_argument("--formats", default="torch,onnx", help="export formats: torch, exported (.pt2), onnx")
parser.add_argument("--out", default="", help="where the exports go (default: a temporary folder)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--quick", action="store_true", help="5 steps, 64 training and 32 dev sentences")
args = parser.parse_args()
if args.quick:
    args.steps, args.train_sentences, args.dev_sentences = 5, 64, 32
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)

# ---- data: words -> ids, UPOS tags -> classes ------------------------------------------
train_trees = data.read_conllu(data.ewt_path("train"))[: args.train_sentences or None]
dev_trees = data.read_conllu(data.ewt_path("dev"))[: args.dev_sentences or None]
vocabulary = data.Vocabulary.build([s.words for s in train_trees], max_size=10_000)
tags = sorted({tag for s in train_trees for tag in s.upos})


def encode(trees):  # (token ids, tag ids); a tag unseen in training counts as an error
    return [(vocabulary.encode(s.words), [tags.index(t) if t in tags else IGNORE for t in s.upos]) for s in trees]


train_set = encode(train_trees)
dev_set = sorted(encode(dev_trees), key=lambda example: len(example[0]))  # less padding

# ---- the model: declared, so it exports with no code -----------------------------------
config = PTConfig(
    vocab_size=len(vocabulary),
    labels=32,  # latent labels per word (the CRF's Z_i), mapped to the UPOS tags by a linear head
    channels=2,  # head variables per word (attention heads)
    rank=8,
    iterations=3,  # mean-field iterations (layers)
    topology="full()",  # every word may choose every other word as its head
    pairwise=args.pairwise,  # "chain()": label transitions between neighbouring words
    task="tagging",
    num_classes=len(tags),
    dropout=0.1,
)
model = ProbabilisticTransformer(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
warmup = max(1, args.steps // 20)  # linear warm-up, then linear decay to 0
schedule = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda step: min((step + 1) / warmup, max(0.0, (args.steps - step) / (args.steps - warmup + 1)))
)


@torch.no_grad()
def predict(tagger, examples, batch_size=64):
    """Tag ids of every word of ``examples``, batched by length; ``tagger(tokens, mask)``
    gives logits (the model's first output, or a loaded export's only one)."""
    predictions = []
    for start in range(0, len(examples), batch_size):
        tokens, mask, _ = collate(examples[start : start + batch_size])
        logits = tagger(tokens, mask)
        logits = logits[0] if isinstance(logits, tuple) else logits
        predictions += [
            row[: len(ids)] for row, (ids, _) in zip(logits.argmax(-1), examples[start : start + batch_size])
        ]
    return predictions


def accuracy(tagger, examples) -> float:
    correct = sum(int((p == torch.tensor(t)).sum()) for p, (_, t) in zip(predict(tagger, examples), examples))
    return correct / sum(len(t) for _, t in examples)


# ---- train: cross-entropy of the tags under the mean-field posterior --------------------
started, cpu_started, step, epoch = time.time(), time.process_time(), 0, 0
while step < args.steps:
    for batch in epoch_order([len(ids) for ids, _ in train_set], args.batch_size, args.seed, epoch):
        tokens, mask, targets = collate([train_set[i] for i in batch])
        logits, _ = model(tokens, mask)
        loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        if step % 100 == 0 or step == args.steps:
            print(
                f"step {step}/{args.steps}: loss {loss.item():.4f} ({time.process_time() - cpu_started:.0f} s of CPU)"
            )
        if step == args.steps:
            break
    epoch += 1
seconds, cpu_seconds = time.time() - started, time.process_time() - cpu_started
model.eval()
dev_accuracy = accuracy(model, dev_set)
print(
    f"dev UPOS accuracy {dev_accuracy:.4f} ({len(dev_set)} sentences, pairwise={args.pairwise!r}, "
    f"{args.steps} steps in {seconds:.0f} s, {cpu_seconds:.0f} s of CPU, {args.threads} thread(s))"
)

# ---- export, reload, check the tags ------------------------------------------------------
out = Path(args.out or tempfile.mkdtemp(prefix="pos_tagger."))
sample = dev_set[:: max(1, len(dev_set) // 64)]  # every length, padded together
expected = predict(model, sample)
for format in args.formats.split(","):
    path = out / {"torch": "tagger", "exported": "tagger.pt2", "onnx": "tagger.onnx"}[format]
    exporter.export(model, path, format=format, vocabulary=vocabulary)  # checks its own logits too
    same = all(torch.equal(a, b) for a, b in zip(predict(load(path), sample), expected))
    print(f"{format}: {path} reloaded, tags equal: {same}")
