"""The transformer variants as PT engine options, at equal budget on PTB MLM
(configs/variants/: 8,000 PTB sentences, one epoch, 250 steps of 32; 500 validation
sentences), plus the pre-LN vs post-LN warm-up sensitivity of the BERT-style baseline.

    .venv/bin/python benchmarks/variants.py                   # every config in configs/variants
    .venv/bin/python benchmarks/variants.py --configs pt-act,pt-exit

Per run: parameters, tokens/s, validation masked perplexity, and what the variant
learned: ACT's mean iterations and ponder cost, the exit sweep (perplexity against the
mean number of iterations as the confidence threshold falls), the learned spans per
channel, the ternary parameter count of the tensor forms. One torch thread.
Runs go to runs/benchmarks/variants/<config>; results to docs/benchmarks/variants.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from probformer.training import run_config
from probformer.training.corpus import IGNORE, collate, inputs_and_targets, prepare_corpus
from probformer.training.evaluate import load_any
from probformer.training.trainer import train

CONFIGS = Path("configs/variants")
EXIT_THRESHOLDS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02)


@torch.no_grad()
def validation(model, corpus, vocab_size: int) -> dict:
    """Masked perplexity (the trainer's fixed masks) and mean iterations per real token."""
    generator = torch.Generator().manual_seed(313)
    examples = corpus.valid
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    loss, count, updates, ponder, tokens_seen = 0.0, 0, 0.0, 0.0, 0
    for start in range(0, len(order), 64):
        tokens, mask, labels = collate([examples[i] for i in order[start : start + 64]])
        inputs, targets = inputs_and_targets("mlm", tokens, mask, labels, vocab_size, 0.15, generator)
        logits, posterior = model(inputs, mask)
        loss += F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="sum").item()
        count += int((targets != IGNORE).sum())
        tokens_seen += int(mask.sum())
        halting = posterior.halting or {}
        n = mask.shape[1]
        if "updates" in halting:
            updates += float((halting["updates"][:, :n] * mask).sum())
        if "ponder" in halting:
            ponder += float((halting["ponder"][:, :n] * mask).sum())
    result = {"perplexity": math.exp(loss / count)}
    if updates:
        result["mean_iterations"] = updates / tokens_seen
    if ponder:
        result["mean_ponder"] = ponder / tokens_seen
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="", help="comma-separated names in configs/variants (default: all)")
    parser.add_argument("--steps", type=int, default=0, help="override train.steps (a smoke run; 0: the budget)")
    parser.add_argument("--reuse", action="store_true", help="analyse the existing runs instead of training again")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.configs.split(",") if args.configs else sorted(p.stem for p in CONFIGS.glob("*.toml"))
    out = Path("docs/benchmarks/variants.json")
    for name in names:
        config = run_config.load(CONFIGS / f"{name}.toml")
        if args.steps:
            config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=args.steps))
        run = Path("runs/benchmarks/variants") / name
        if args.reuse:
            summary = json.loads((run / "summary.json").read_text())
        else:
            if run.exists():
                shutil.rmtree(run)
            summary = train(config, run, progress=False)
        row = {
            "command": f"probformer train --config configs/variants/{name}.toml",
            "parameters": summary["parameters"],
            "tokens_per_second": summary["tokens_per_second"],
            "seconds": summary["seconds"],
            "perplexity": summary["valid"]["perplexity"],
        }
        if config.kind == "probabilistic_transformer":
            model, vocabulary = load_any(run)
            model.eval()
            corpus = prepare_corpus(config.data, vocabulary)
            engine, crf = model.mean_field, model.crf
            if engine.halting == "act":
                row["act"] = validation(model, corpus, len(vocabulary))
            if engine.halting == "exit":
                sweep = []
                for threshold in EXIT_THRESHOLDS:
                    engine.exit_threshold = threshold
                    sweep.append({"threshold": threshold, **validation(model, corpus, len(vocabulary))})
                row["exit_sweep"] = sweep
            if engine.span is not None:
                row["spans"] = [round(float(z), 2) for z in engine.spans().detach()]
            row["ternary_parameters"] = crf.ternary_parameter_count()
        print(json.dumps({name: row}), flush=True)
        results = json.loads(out.read_text()) if out.is_file() else {}  # re-read: runs may go in parallel
        results[name] = row
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
