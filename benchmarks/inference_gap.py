"""The inference gap of a trained PT against its number of mean-field iterations and schedule.

    .venv/bin/python -m benchmarks.inference_gap runs/gap-demo-pt [--sentences 16] [--particles 16]
        [--replicates 6] [--iterations 1 2 4 8 16] [--schedules parallel async sequential]
        [--out docs/benchmarks/inference_gap.json]

The model's CRF is fixed (its trained potentials); only the engine's unrolled inference
changes: ``mean_field.iterations`` = T and ``mean_field.schedule``. For each (schedule, T)
and each of the first ``--sentences`` sentences of PTB's valid split (the demo's data),
``probformer.diagnostics.inference_gap`` gives log Z by tempered SMC from that q, the
ELBO and the PSIS k-hat of p(z)/q(z). Every configuration estimates the same log Z of a
sentence; the KL gap is taken against the most precise of them (smallest standard error),
and the largest disagreement between configurations, in standard errors, is printed as a
check. One thread.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

from probformer.diagnostics import inference_gap  # noqa: E402
from probformer.training import evaluate as evaluation  # noqa: E402
from probformer.training.corpus import collate  # noqa: E402


def batch(model_path: str, sentences: int):
    model, vocabulary = evaluation.load_any(model_path)
    texts, _ = evaluation.read_split("ptb", "valid")
    examples, _ = evaluation.encode_windows(texts[:sentences], vocabulary, 10**9)
    tokens, mask, _ = collate(examples)
    return model.eval(), tokens, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a training-run folder or a checkpoint folder of a PT")
    parser.add_argument("--sentences", type=int, default=16)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--replicates", type=int, default=6)
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["parallel", "async", "sequential"])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokens, mask = batch(args.model, args.sentences)
    engine = model.mean_field
    rows = []
    for schedule in args.schedules:
        for iterations in args.iterations:
            engine.schedule, engine.iterations = schedule, iterations
            start = time.perf_counter()
            gap = inference_gap(model, tokens, mask, particles=args.particles, replicates=args.replicates)
            rows.append(
                {
                    "schedule": schedule,
                    "iterations": iterations,
                    "log_partition": gap.log_partition.tolist(),
                    "standard_error": gap.standard_error.tolist(),
                    "elbo": gap.elbo.tolist(),
                    "pareto_k": gap.pareto_k.tolist(),
                    "seconds": time.perf_counter() - start,
                }
            )
            print(f"{schedule:>10} T={iterations:>2}: {rows[-1]['seconds']:.1f}s", flush=True)
    log_z = np.array([r["log_partition"] for r in rows])  # [configs, B]
    se = np.array([r["standard_error"] for r in rows])
    best = log_z[se.argmin(0), np.arange(log_z.shape[1])]
    best_se = se.min(0)
    disagreement = float(np.max(np.abs(log_z - best) / np.sqrt(se**2 + best_se**2 + 1e-12)))
    lengths = mask.sum(1).numpy()
    print(f"{len(lengths)} sentences, {lengths.min()}-{lengths.max()} tokens (mean {lengths.mean():.1f})")
    print(f"log Z: median standard error {np.median(best_se):.3f}; configurations disagree by <= {disagreement:.1f} se")
    print("| schedule | T | KL gap (nats/sentence) | KL gap / token | k-hat median | k-hat > 0.7 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        kl = best - np.array(row["elbo"])
        k = np.array(row["pareto_k"])
        row["kl"] = kl.tolist()
        print(
            f"| {row['schedule']} | {row['iterations']} | {kl.mean():.2f} ± {kl.std(ddof=1) / np.sqrt(len(kl)):.2f} "
            f"| {(kl / lengths).mean():.3f} | {np.median(k):.2f} | {int((k > 0.7).sum())}/{len(k)} |"
        )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "config": vars(args),
                    "lengths": lengths.tolist(),
                    "best_log_partition": best.tolist(),
                    "best_standard_error": best_se.tolist(),
                    "disagreement_se": disagreement,
                    "rows": rows,
                },
                handle,
                indent=1,
            )


if __name__ == "__main__":
    main()
