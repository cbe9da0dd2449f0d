"""Particle Transformer on PTB MLM: literal resampling ("copy") vs residual mixing ("mix")
vs no resampling ("none"), a few seeds each, at a fixed short step budget.

    .venv/bin/python benchmarks/particle_resampling.py --steps 300 --seeds 0,1,2

Each run trains configs/particle-small.toml (width 64, 4 heads, 4 blocks, FFN 256,
resampling every 2 blocks) with ``model.resampling`` and ``model.ess_threshold``
(default 1.0: resample at every resampling layer) set and ``train.steps`` fixed, then
measures on the first ``--sentences`` PTB validation sentences in eval mode: per layer
the mean cosine and effective rank of the token states
(probformer.diagnostics.diversity), the mean ESS/n before resampling, the fraction of
sentences resampled and the fraction of real tokens named by no slot ("killed": for
"copy" the tokens that left no offspring; for "mix", which kills nothing, the tokens no
position drew as its source).
The trainer's final validation perplexity is over the whole validation set.
Runs go to runs/benchmarks/particle-resampling/; results to
docs/benchmarks/particle_resampling.json (mean and sd over seeds per mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from probformer import diagnostics
from probformer.training import run_config
from probformer.training.corpus import collate, prepare_corpus
from probformer.training.evaluate import load_any
from probformer.training.trainer import train

MODES = ("copy", "mix", "none")


@torch.no_grad()
def measure(run: Path, config: run_config.RunConfig, sentences: int) -> dict:
    model, vocabulary = load_any(run)
    model.eval()
    corpus = prepare_corpus(config.data, vocabulary)
    tokens, mask, _ = collate(corpus.valid[:sentences])
    _, trace = model(tokens, mask)
    layers = []
    for layer in range(trace["hidden"].shape[0]):
        d = diagnostics.diversity(trace["hidden"][layer].float(), mask)
        ancestors = trace["ancestors"][layer]
        # tokens with no offspring: real slots j that no real slot names as its ancestor
        # (padded slots name themselves)
        named = torch.zeros_like(mask).scatter_(1, ancestors, mask)
        killed = ((mask & ~named).sum() / mask.sum()).item()
        layers.append(
            {
                "cosine": float(d.cosine.mean()),
                "effective_rank": float(d.effective_rank.mean()),
                "ess": float(trace["ess"][layer].mean()),
                "resampled": float(trace["resampled"][layer].float().mean()),
                "killed": killed,
            }
        )
    return {"parameters": sum(p.numel() for p in model.parameters()), "layers": layers}


def summarise(runs: list[dict]) -> dict:
    def mean_sd(values):
        return [statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0]

    layers = len(runs[0]["layers"])
    return {
        "perplexity": mean_sd([r["perplexity"] for r in runs]),
        "parameters": runs[0]["parameters"],
        "layers": [
            {k: mean_sd([r["layers"][i][k] for r in runs]) for k in runs[0]["layers"][i]} for i in range(layers)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/particle-small.toml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--ess-threshold", type=float, default=1.0, help="1.0: resample every K blocks")
    parser.add_argument("--out", default="docs/benchmarks/particle_resampling.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = run_config.load(args.config)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {"command": "", "steps": args.steps, "seeds": seeds, "config": args.config, "runs": {}, "modes": {}}
    results["command"] = (
        f".venv/bin/python benchmarks/particle_resampling.py --steps {args.steps} --seeds {args.seeds} "
        f"--modes {args.modes} --sentences {args.sentences} --ess-threshold {args.ess_threshold}"
    )
    start = time.perf_counter()
    for seed in seeds:  # seed-major: an interrupted run still has every mode at the first seeds
        for mode in args.modes.split(","):
            config = dataclasses.replace(
                base,
                model={**base.model, "resampling": mode, "ess_threshold": args.ess_threshold},
                train=dataclasses.replace(base.train, seed=seed, steps=args.steps, eval_every=0, checkpoint_every=0),
            )
            run = Path("runs/benchmarks/particle-resampling") / f"{mode}-{seed}"
            if run.exists():
                shutil.rmtree(run)
            summary = train(config, run, progress=False)
            row = {
                "perplexity": summary["valid"]["perplexity"],
                "seconds": summary["seconds"],
                **measure(run, config, args.sentences),
            }
            results["runs"][f"{mode}-{seed}"] = row
            brief = {"mode": mode, "seed": seed, "perplexity": row["perplexity"], "seconds": row["seconds"]}
            print(json.dumps(brief), flush=True)
            for name in args.modes.split(","):
                done = [v for k, v in results["runs"].items() if k.rsplit("-", 1)[0] == name]
                if done:
                    results["modes"][name] = summarise(done)
            results["wall_seconds"] = time.perf_counter() - start
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
