"""The measurements of ``benchmarks/gpu_check.py``, one function per target.

Every stage takes ``Sizes`` (the full sizes on CUDA, tiny ones for the CPU dry run) and
returns a dict of measured numbers; ratios are taken between runs of the same process on
the same device. Times: the median of ``sizes.rounds`` runs after ``sizes.warmup`` runs
(which include compilation), each run synchronised on CUDA. On the CPU (the dry run) the
engines use the fused kernel: flex refuses to train there.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

import graphs
import inference


@dataclass(frozen=True)
class Sizes:
    """d, C, r, B, T and the lengths of each stage (the GPU targets' reference sizes when full)."""

    labels: int = 256
    channels: int = 8
    rank: int = 64
    batch: int = 8
    iterations: int = 4
    lengths: tuple[int, ...] = (512, 4096)
    topology_length: int = 8192
    window: int = 256
    segment: int = 512
    memory_lengths: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    matmul: int = 8192
    smc_particles: int = 1000
    smc_steps: int = 50
    smc_filters: int = 64
    pyro_filters: int = 4  # SMCFilter runs filters one after another: its rate per filter is what counts
    train_length: int = 512
    train_vocab: int = 10000
    train_steps: int = 50
    warmup: int = 2
    rounds: int = 5


TINY = Sizes(labels=16, channels=2, rank=4, batch=2, iterations=2, lengths=(16, 32), topology_length=64, window=4,
             segment=8, memory_lengths=(16, 32, 64), matmul=64, smc_particles=50, smc_steps=5, smc_filters=4,
             pyro_filters=1, train_length=16, train_vocab=50, train_steps=3, warmup=1, rounds=1)  # fmt: skip


def write_line(line: dict, path) -> None:
    """Print ``line`` as JSON and append it to the JSON-lines file ``path`` (the experiment
    scripts' record: each line is kept as soon as it is measured)."""
    print(json.dumps(line), flush=True)
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, device: torch.device, sizes: Sizes) -> float:
    """Median seconds of ``run()`` over ``sizes.rounds`` after ``sizes.warmup`` runs."""
    for _ in range(sizes.warmup):
        run()
    times = []
    for _ in range(sizes.rounds):
        synchronise(device)
        start = time.perf_counter()
        run()
        synchronise(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def matmul_peak(device: torch.device, sizes: Sizes) -> dict:
    """The measured bf16 matmul rate, the denominator of every "% of peak"."""
    m = sizes.matmul
    a, b = (torch.randn(m, m, device=device, dtype=torch.bfloat16) for _ in range(2))
    seconds = timed(lambda: a @ b, device, sizes)
    return {"bf16_matmul_tflops": 2 * m**3 / seconds / 1e12, "size": m}


def kernel_for(device: torch.device) -> str:
    return "flex" if device.type == "cuda" else "fused"


def pt_engine(sizes: Sizes, topology: str, form: str, device: torch.device):
    """graphs.CRF + inference.MeanField as a user builds them, and an embedding input."""
    crf = graphs.CRF(vocab_size=100, labels=sizes.labels, channels=sizes.channels, rank=sizes.rank,
                     topology=topology, gamma=3, global_labels=4 * sizes.labels,
                     **({"ternary_form": "shared"} if form == "shared" else {}))  # fmt: skip
    engine = inference.MeanField(crf, iterations=sizes.iterations, kernel=kernel_for(device), weights="reference")
    return engine.to(device)


def pt_step(engine, n: int, sizes: Sizes, device: torch.device):
    tokens = torch.randint(0, 100, (sizes.batch, n), device=device)

    def run():
        with autocast(device):
            logits = engine(tokens).logits
        logits.float().square().mean().backward()

    return run


def pt_flops(sizes: Sizes, n: int, groups: int) -> float:
    """Algorithmic forward + backward FLOPs (3 x forward) of T iterations: projections onto
    ``groups`` slots (q and k), attention forward and reverse (scores and weighted sums over
    every arc, 8 B C n^2 r), back-projection of both messages, and the global variable."""
    B, d, C, r, g = sizes.batch, sizes.labels, sizes.channels, sizes.rank, 4 * sizes.labels
    projections = 4 * B * n * d * groups * C * r + 4 * B * n * groups * C * r * d  # q and k; both messages back
    forward = projections + 8 * B * C * n * n * r + 4 * B * n * d * g
    return 3 * sizes.iterations * forward


def reference_layer_step(sizes: Sizes, n: int, device: torch.device):
    """nn.TransformerEncoderLayer (SDPA) applied T times, forward and backward, bf16 autocast."""
    layer = nn.TransformerEncoderLayer(sizes.labels, sizes.channels, 4 * sizes.labels, dropout=0.0, batch_first=True)
    layer = layer.to(device)
    x = torch.randn(sizes.batch, n, sizes.labels, device=device)

    def run():
        with autocast(device):
            h = x
            for _ in range(sizes.iterations):
                h = layer(h)
        h.float().square().mean().backward()

    return run


def past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def pt_against_layer(device: torch.device, sizes: Sizes, peak_tflops: float, deadline=None) -> list[dict]:
    rows = []
    for n in sizes.lengths:
        reference = timed(reference_layer_step(sizes, n, device), device, sizes)
        for form in ("grouped", "shared"):
            if past(deadline):
                rows.append({"n": n, "form": form, "not_run": "past the time budget"})
                continue
            engine = pt_engine(sizes, "full", form, device)
            seconds = timed(pt_step(engine, n, sizes, device), device, sizes)
            groups = 1 if form == "shared" else engine.crf.num_groups
            tflops = pt_flops(sizes, n, groups) / seconds / 1e12
            rows.append({"n": n, "form": form, "pt_s": seconds, "layer_s": reference, "ratio": seconds / reference,
                         "pt_tflops": tflops, "pct_of_peak": 100 * tflops / peak_tflops})  # fmt: skip
            del engine
    return rows


def topology_ratios(device: torch.device, sizes: Sizes, deadline=None) -> dict:
    """PT forward + backward on causal, window and segments against full, at one length."""
    n, one = sizes.topology_length, replace(sizes, batch=1)
    topologies = {"full": "full", "causal": "causal", "window": f"window({sizes.window})",
                  "segments": f"segments({sizes.segment})"}  # fmt: skip
    seconds = {}
    for name, text in topologies.items():
        if not past(deadline):
            seconds[name] = timed(pt_step(pt_engine(one, text, "grouped", device), n, one, device), device, one)
    ratios = {name: seconds[name] / seconds["full"] for name in seconds if "full" in seconds}
    return {"n": n, "seconds": seconds, **ratios}


def memory_growth(device: torch.device, sizes: Sizes, deadline=None) -> dict:
    """Peak CUDA memory of one PT forward + backward (B = 1, causal) from the shortest to the
    longest length, and the largest deviation from the straight line through the ends."""
    if device.type != "cuda":
        return {"note": "peak memory is read on CUDA only"}
    one, peaks = replace(sizes, batch=1), {}
    for n in sizes.memory_lengths:
        if past(deadline):
            return {"peak_bytes": peaks, "not_run": f"n >= {n}: past the time budget"}
        engine = pt_engine(one, "causal", "grouped", device)
        step = pt_step(engine, n, one, device)
        step()  # compiled and cached
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        peaks[n] = torch.cuda.max_memory_allocated(device) - base
        del engine, step
    lo, hi = min(peaks), max(peaks)
    slope = (peaks[hi] - peaks[lo]) / (hi - lo)
    deviation = max(abs(peaks[n] - (peaks[lo] + slope * (n - lo))) / peaks[n] for n in peaks)
    return {"peak_bytes": peaks, "max_deviation_from_linear": deviation}


SMC_MODEL = (0.9, 0.5, 0.3)  # the linear-Gaussian model's a, q, r: x' = a x + N(0, q), y = x + N(0, r)


def smc_run(device: torch.device, sizes: Sizes, generator: torch.Generator | None, validate: bool = True):
    """``(run, ys)``: ``run()`` filters ``sizes.smc_filters`` observation series ``ys`` of the
    linear-Gaussian model at once with inference.SMC (float32 tensor callables), drawing from
    ``generator`` (None: torch's global one); it returns the ``SMCResult``."""
    N, T = sizes.smc_particles, sizes.smc_steps
    a, q, r = SMC_MODEL
    ys = torch.randn(sizes.smc_filters, T, device=device, generator=generator)

    def step(t, x):
        x = a * x + q**0.5 * torch.randn(x.shape, device=device, generator=generator)
        return x, -0.5 / r * (ys[:, t, None] - x) ** 2

    def init(batch):
        return torch.randn(batch, N, device=device, generator=generator)

    smc = inference.SMC(N, generator=generator, validate=validate)
    return (lambda: smc.filter(init, step, num_steps=T, batch_size=sizes.smc_filters)), ys


def smc_against_smcfilter(device: torch.device, sizes: Sizes) -> dict:
    """Particle-steps per second: inference.SMC on the device (float32 tensor callables, all
    filters as one batch) against pyro.infer.SMCFilter (float64, CPU, one filter at a time)
    on the same linear-Gaussian model (benchmarks/smc.py's)."""
    N, T = sizes.smc_particles, sizes.smc_steps
    run, ys = smc_run(device, sizes, torch.Generator(device=device).manual_seed(0))
    ours = timed(run, device, sizes)
    result = {"ours_particle_steps_per_s": sizes.smc_filters * N * T / ours}
    try:
        import pyro  # noqa: F401  (carried as a wheel to the GPU machine)
    except ImportError:
        return {**result, "smcfilter": "pyro-ppl is not installed: carry its wheel (docs/benchmarks.md)"}
    pyro_seconds = timed(lambda: _run_smcfilter(ys.double().cpu(), sizes, *SMC_MODEL), torch.device("cpu"), sizes)
    theirs = sizes.pyro_filters * N * T / pyro_seconds
    return {**result, "smcfilter_particle_steps_per_s": theirs, "ratio": result["ours_particle_steps_per_s"] / theirs}


def _run_smcfilter(ys, sizes: Sizes, a: float, q: float, r: float) -> None:
    import pyro
    import pyro.distributions as dist

    class Model:
        def init(self, state):
            state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

        def step(self, state, y=None):
            state["x"] = pyro.sample("x", dist.Normal(a * state["x"], q**0.5))
            pyro.sample("y", dist.Normal(state["x"], r**0.5), obs=y)

    class Guide:  # the bootstrap proposal: the transition, writing nothing to the state
        def init(self, state):
            pyro.sample("x_init", dist.Normal(0.0, 1.0))

        def step(self, state, y=None):
            pyro.sample("x", dist.Normal(a * state["x"], q**0.5))

    for f in range(sizes.pyro_filters):
        smc = pyro.infer.SMCFilter(Model(), Guide(), num_particles=sizes.smc_particles, max_plate_nesting=0)
        smc.init()
        for t in range(sizes.smc_steps):
            smc.step(ys[f, t])


def _training_models(sizes: Sizes, device: torch.device):
    from probformer.models.baselines import Transformer, TransformerConfig, equal_size
    from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig

    pt = ProbabilisticTransformer(PTConfig(vocab_size=sizes.train_vocab, labels=sizes.labels, channels=sizes.channels,
                                           rank=sizes.rank, iterations=sizes.iterations, dropout=0.0,
                                           kernel=kernel_for(device), global_labels=4 * sizes.labels))  # fmt: skip
    target = sum(p.numel() for p in pt.parameters())
    template = TransformerConfig(vocab_size=sizes.train_vocab, heads=sizes.channels, layers=sizes.iterations,
                                 max_length=sizes.train_length, dropout=0.0)  # fmt: skip
    bert = Transformer(equal_size(template, target))
    return {"pt": pt.to(device), "bert": bert.to(device)}, target


def training_throughput(device: torch.device, sizes: Sizes) -> dict:
    """MLM training steps (AdamW, bf16 autocast) of PT and BERT at equal parameters: tokens/s,
    then a 50-step PT loop counting Dynamo compiles and host synchronisations after warm-up."""
    models, parameters = _training_models(sizes, device)
    tokens = torch.randint(1, sizes.train_vocab, (sizes.batch, sizes.train_length), device=device)
    steps, rates = {}, {}
    for name, model in models.items():
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimiser=optimiser):
            with autocast(device):
                logits = model(tokens)[0]
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
            loss.backward()
            optimiser.step()
            optimiser.zero_grad(set_to_none=True)

        steps[name] = step
        rates[name] = sizes.batch * sizes.train_length / timed(step, device, sizes)
    return {"parameters": parameters, "tokens_per_s": rates, "ratio": rates["pt"] / rates["bert"],
            **_compiles_and_syncs(steps["pt"], device, sizes)}  # fmt: skip


# what CUDA's sync debug mode says at each synchronising call; its one-off notice that the mode
# is a prototype ("Synchronization debug mode is ...") is not a sync
SYNC_WARNING = "called a synchronizing CUDA operation"


def sync_warnings(caught: list) -> list:
    """The warnings of ``caught`` that report a synchronising CUDA call."""
    return [w for w in caught if SYNC_WARNING in str(w.message)]


def _compiles_and_syncs(step, device: torch.device, sizes: Sizes) -> dict:
    from torch._dynamo.utils import counters

    for _ in range(sizes.warmup):
        step()
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(sizes.train_steps):
                step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        syncs = sync_warnings(caught)
    # where each sync was asked for (the warning's Python frame), so the next run can name it
    sites = sorted({f"{w.filename}:{w.lineno}" for w in syncs})
    return {"loop_steps": sizes.train_steps, "recompiles_after_warmup": counters["stats"]["unique_graphs"] - before,
            "host_syncs_in_loop": len(syncs) if device.type == "cuda" else None,
            "host_sync_sites": sites[:8]}  # fmt: skip


def finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
