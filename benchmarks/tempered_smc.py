"""Tempered SMC on a CRF the size of a PT layer, and its Gibbs sweep against NumPyro's.

    .venv/bin/python -m benchmarks.tempered_smc [--particles 16] [--replicates 6] [--target-ess 0.8]
        [--rounds 4] [--numpyro-draws 4 12] [--out docs/benchmarks/tempered_smc.json]

The CRF: n = 128 tokens, d = 32 labels, C = 4 channels, rank r = 16, full topology, B = 16
sentences of random token ids (vocabulary 1,000), parameters at their initialisation (seed
0). One thread (torch.set_num_threads(1), OMP_NUM_THREADS=1, JAX on the CPU).

1. ``inference.TemperedSMC`` (MeanField proposal, 4 iterations): wall time of ``run`` (the
   proposal, the pilot and the replicates), the per-sentence log Z and its standard error.
2. One batched Gibbs sweep (``inference.smc.tempered.gibbs_moves.sweep``: every head and global, then
   ``--rounds`` label rounds) of the run's layout, timed per particle: one new state of all
   B sentences.
3. ``inference.Gibbs`` (NumPyro ``DiscreteGibbs``, 1 chain) on the same CRF and batch: the
   time of ``MCMC.run`` for two numbers of draws (no warm-up; the engine is stopped right
   after it, before its ArviZ summaries); their difference over the difference of draws is
   the time per draw (JIT compilation cancels). One NumPyro draw
   updates one label of the batch; the sweep updates every head and, on average, most labels
   of every sentence (the share is printed), so the ratio per draw and the ratio per label
   update are both reported.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
import torch  # noqa: E402

import graphs  # noqa: E402
import inference  # noqa: E402
from inference.smc.tempered import gibbs_moves  # noqa: E402
from inference.smc.tempered.sampler import TemperedSMC  # noqa: E402
from inference.smc.tempered.target import compile_target  # noqa: E402

B, N, D, C, RANK, VOCAB = 16, 128, 32, 4, 16, 1000


def problem(seed: int = 0):
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=VOCAB, labels=D, channels=C, rank=RANK, topology="full")
    tokens = torch.randint(VOCAB, (B, N), generator=torch.Generator().manual_seed(seed))
    return crf, tokens


def time_smc(crf, tokens, args) -> dict:
    engine = TemperedSMC(
        crf,
        num_particles=args.particles,
        replicates=args.replicates,
        target_ess=args.target_ess,
        rounds=args.rounds,
        seed=0,
    )
    start = time.perf_counter()
    result = engine.run(tokens)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "steps": result.steps,
        "log_partition": result.log_partition.tolist(),
        "standard_error": result.standard_error.tolist(),
        "max_standard_error": float(result.standard_error.max()),
    }


def time_sweep(crf, tokens, args, repeats: int = 3) -> dict:
    """Seconds per particle of one sweep at beta = 1/2, and the share of labels it updates."""
    with torch.no_grad():
        proposal = inference.MeanField(crf, iterations=4, kernel="naive")(tokens)
        mask = torch.ones(B, N, dtype=torch.bool)
        target = compile_target(crf, tokens, mask, proposal, 1e-6, args.replicates)
        z, h, g = target.sample_proposal(args.particles, torch.Generator().manual_seed(1))
        beta = torch.full((z.shape[0],), 0.5, dtype=torch.float64)
        gibbs_moves.sweep(target, z, h, g, beta, args.rounds)  # builds the cached tables
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            moved, _, _ = gibbs_moves.sweep(target, z, h, g, beta, args.rounds)
            best = min(best, time.perf_counter() - start)
        particles = z.shape[0] * z.shape[1] / B  # draws of the whole batch
        # the share of labels a sweep updates: rounds of the colouring (labels may keep their value)
        heads = gibbs_moves.sample_heads(target, z, beta)
        waiting = target.per_system(target.nodes)[:, None].expand_as(z).clone()
        priority = torch.rand(z.shape)
        for _ in range(args.rounds):
            active = torch.where(waiting, priority, -1.0)
            waiting &= ~(priority > gibbs_moves._neighbour_priority(target, active, heads))
    return {
        "seconds_per_draw": best / particles,
        "labels_updated_share": 1 - float(waiting.float().mean()),
        "changed_share": float((moved != z).float().mean()),
    }


class _SamplerTimed(Exception):
    """Raised right after NumPyro's sampler: the engine's summaries (ArviZ ESS of a million
    values per draw) take minutes and are no part of sampling."""


def time_numpyro(crf, tokens, draws: list[int]) -> dict:
    """Seconds per NumPyro draw: ``MCMC.run`` inside ``inference.Gibbs.sample`` timed for
    two numbers of draws (the engine stops right after it)."""
    from numpyro.infer import MCMC

    timings, original = [], MCMC.run

    def timed_run(self, *args, **kwargs):
        start = time.perf_counter()
        original(self, *args, **kwargs)
        self.get_samples()["z"].block_until_ready()
        timings.append(time.perf_counter() - start)
        raise _SamplerTimed

    MCMC.run = timed_run
    try:
        for count in draws:
            try:
                inference.Gibbs(crf, num_samples=count, num_warmup=0, num_chains=1, seed=0).sample(tokens)
            except _SamplerTimed:
                pass
    finally:
        MCMC.run = original
    per_draw = (timings[1] - timings[0]) / (draws[1] - draws[0])
    return {"draws": draws, "run_seconds": timings, "seconds_per_draw": per_draw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--replicates", type=int, default=6)
    parser.add_argument("--target-ess", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--numpyro-draws", type=int, nargs=2, default=[4, 12])
    parser.add_argument("--skip-numpyro", action="store_true")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    crf, tokens = problem()
    figures = {"config": vars(args), "smc": time_smc(crf, tokens, args), "sweep": time_sweep(crf, tokens, args)}
    print(json.dumps(figures["smc"], indent=1))
    print(json.dumps(figures["sweep"], indent=1))
    if not args.skip_numpyro:
        figures["numpyro"] = time_numpyro(crf, tokens, args.numpyro_draws)
        sweep, numpyro = figures["sweep"], figures["numpyro"]
        figures["speedup_per_draw"] = numpyro["seconds_per_draw"] / sweep["seconds_per_draw"]
        updates_per_sweep = sweep["labels_updated_share"] * B * N
        figures["speedup_per_label_update"] = figures["speedup_per_draw"] * updates_per_sweep
        print(
            json.dumps({k: figures[k] for k in ("numpyro", "speedup_per_draw", "speedup_per_label_update")}, indent=1)
        )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
