"""Train run configs one after another and report validation metrics, tokens/second,
parameters and (with --diversity) per-layer representation diversity on validation
sentences. The PTB MLM comparison of docs/benchmarks.md:

    .venv/bin/python benchmarks/training.py --name ptb_mlm \
        --configs pt-small,bert-small,ut-small,pt-medium,bert-medium,ut-medium
    .venv/bin/python benchmarks/training.py --name particle --diversity \
        --configs particle-small,particle-small-noresample
    .venv/bin/python benchmarks/training.py --name ewt --configs pt-pos-ewt,pt-mlm-ewt --uas

Runs go to runs/benchmarks/<config>; results to docs/benchmarks/<name>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from probformer import diagnostics
from probformer.training import run_config
from probformer.training.corpus import collate, prepare_corpus
from probformer.training.trainer import train


@torch.no_grad()
def layer_diversity(run: Path, config: run_config.RunConfig, sentences: int = 64) -> list[dict]:
    from probformer.training.evaluate import load_any

    model, vocabulary = load_any(run)
    model.eval()
    corpus = prepare_corpus(config.data, vocabulary)
    tokens, mask, _ = collate(corpus.valid[:sentences])
    hidden = model.diagnostic_trace(tokens, mask)["hidden"]  # [L, B, n(+virtual), D]
    rows = []
    for layer in hidden:
        d = diagnostics.diversity(layer[:, : mask.shape[1]].float(), mask)
        rows.append({k: float(getattr(d, k).mean()) for k in ("cosine", "effective_rank", "rank_one_distance")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True, help="comma-separated names in configs/")
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, default=0, help="override train.steps (0: the configs' budget)")
    parser.add_argument("--diversity", action="store_true")
    parser.add_argument("--uas", action="store_true", help="score PT head posteriors against EWT gold heads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path("docs/benchmarks") / f"{args.name}.json"
    results = json.loads(out.read_text()) if out.is_file() else {}
    for name in args.configs.split(","):
        config = run_config.load(Path("configs") / f"{name}.toml")
        if args.steps:
            import dataclasses

            config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=args.steps))
        run = Path("runs/benchmarks") / name
        if run.exists():
            import shutil

            shutil.rmtree(run)
        summary = train(config, run, progress=False)
        row = {**summary, "command": f"probformer train --config configs/{name}.toml"}
        if args.diversity:
            row["diversity"] = layer_diversity(run, config)
        if args.uas and config.kind == "probabilistic_transformer":
            from probformer.training.evaluate import evaluate

            row["uas"] = evaluate(run, "uas", "ewt")
        results[name] = row
        print(json.dumps({k: v for k, v in row.items() if k != "diversity"}), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
