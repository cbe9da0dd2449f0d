"""Long-range recall (probformer.training.recall): the folded-context model against the plain
sliding-window model with the same parameters, both with a 12-token window.

    .venv/bin/python benchmarks/recall.py                 # train both, evaluate, stream memory
    .venv/bin/python benchmarks/recall.py --reuse         # evaluate the saved models again

Training: one key per sequence, distances from a curriculum (1..12 for the first quarter
of the steps, then a maximum that grows to --max-distance), AdamW, one torch thread.
Evaluation: accuracy of the key prediction on 256 fresh sequences per distance (chance
1/8). Streaming memory: the folded network and the folded mean field (a CRF on segments(12))
stream L = 10^3 .. 10^5 tokens in a fresh process each; peak resident memory (VmHWM)
and the bytes of the stream state are recorded (`--stream-only` measures just that).
Results: docs/benchmarks/recall.json and docs/benchmarks/recall.png.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from probformer.models.folded_context import FoldedContext, FoldedContextConfig, FoldedStreamState
from probformer.training.corpus import IGNORE
from probformer.training.recall import RecallTask

TASK = RecallTask(keys=8, fillers=16, offset=12)
MODEL = dict(width=64, heads=4, local_layers=2, global_layers=2, ffn_width=256, segment=12)
DISTANCES = (6, 12, 25, 50, 100, 150, 200, 300, 500, 1000)
RUNS = Path("runs/benchmarks/recall")
OUT = Path("docs/benchmarks/recall.json")


def build(folded: bool) -> FoldedContext:
    torch.manual_seed(0)
    return FoldedContext(FoldedContextConfig(vocab_size=TASK.vocab_size, folded=folded, **MODEL))


def curriculum(step: int, steps: int, max_distance: int, generator) -> int:
    warm = steps // 4
    if step < warm:
        high = TASK.offset
    else:
        grown = (step - warm) / max(1, int(0.75 * steps) - warm)
        high = round(TASK.offset + min(1.0, grown) * (max_distance - TASK.offset))
    return int(torch.randint(1, high + 1, (1,), generator=generator))


def train(model, steps: int, max_distance: int, lr: float, name: str) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    started, log = time.perf_counter(), []
    model.train()
    for step in range(steps):
        distance = curriculum(step, steps, max_distance, generator)
        tokens, targets = TASK.batch(32, distance, generator)
        logits, _ = model(tokens)
        loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log.append({"step": step, "distance": distance, "loss": loss.item()})
            print(
                f"{name} step {step} distance {distance} loss {loss.item():.3f} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    return {"seconds": time.perf_counter() - started, "log": log}


@torch.no_grad()
def accuracy(model, distances=DISTANCES) -> dict[int, float]:
    model.eval()
    found = {}
    for distance in distances:
        tokens, targets = TASK.batch(256, distance, torch.Generator().manual_seed(10_000 + distance))
        chosen = targets != IGNORE
        found[distance] = (model(tokens)[0].argmax(-1)[chosen] == targets[chosen]).float().mean().item()
    return found


def peak_resident_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it does not carry
    the parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


def stream_memory(length: int, view: str = "network") -> dict:
    """Run in a fresh process: stream ``length`` tokens in chunks of 100 through the
    folded network ("network") or the folded mean field of a CRF on segments(12) ("crf")."""
    torch.set_num_threads(1)
    if view == "network-whole":  # the same network on the whole input at once, for contrast
        model = build(True).eval()
        tokens = torch.randint(0, TASK.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        started = time.perf_counter()
        with torch.no_grad():
            model(tokens)
        return {
            "view": view,
            "tokens": length,
            "peak_rss_mb": peak_resident_mb(),
            "tokens_per_second": length / (time.perf_counter() - started),
        }
    if view == "network":
        model, state = build(True).eval(), FoldedStreamState()
    else:
        import graphs
        import inference

        torch.manual_seed(0)
        crf = graphs.CRF(
            TASK.vocab_size,
            labels=32,
            channels=2,
            rank=8,
            global_labels=32,
            topology=graphs.topology.segments(MODEL["segment"], causal=True),
        )
        model, state = inference.Folded(inference.MeanField(crf, iterations=3)), inference.FoldState()
    generator = torch.Generator().manual_seed(0)
    started, seen = time.perf_counter(), 0
    with torch.no_grad():
        chunks = (
            torch.randint(0, TASK.vocab_size, (1, min(100, length - i)), generator=generator)
            for i in range(0, length, 100)
        )
        for piece in model.stream(chunks, state):
            seen += piece.shape[1]
            state_bytes = sum(t.numel() * t.element_size() for t in state.tensors().values())
            largest = max(max(t.shape) for t in state.tensors().values())
    return {
        "view": view,
        "tokens": seen,
        "peak_rss_mb": peak_resident_mb(),
        "state_bytes": state_bytes,
        "largest_state_axis": largest,
        "tokens_per_second": seen / (time.perf_counter() - started),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--max-distance", type=int, default=240)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--reuse", action="store_true", help="evaluate the saved models, no training")
    parser.add_argument("--models", default="folded,windowed")
    parser.add_argument("--stream-only", action="store_true", help="only the streaming memory of both views")
    parser.add_argument("--stream-length", type=int, default=0, help=argparse.SUPPRESS)  # the subprocess
    parser.add_argument("--stream-view", default="network", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.stream_length:
        print(json.dumps(stream_memory(args.stream_length, args.stream_view)))
        return
    if args.stream_only:
        measure_streams(("network", "network-whole", "crf"))
        plot(json.loads(OUT.read_text()))
        return
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for name in args.models.split(","):
        model = build(name == "folded")
        path = RUNS / name / "model.safetensors"
        entry = results.get(name, {})
        if args.reuse:
            model.load_state_dict(load_file(str(path)))
        else:
            entry = {
                "steps": args.steps,
                "max_distance": args.max_distance,
                "lr": args.lr,
                **train(model, args.steps, args.max_distance, args.lr, name),
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        entry["parameters"] = sum(p.numel() for p in model.parameters())
        entry["accuracy"] = accuracy(model)
        print(name, entry["accuracy"], flush=True)
        results = json.loads(OUT.read_text()) if OUT.is_file() else {}  # parallel runs write too
        results[name] = entry
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(results, indent=1))
    if "folded" in args.models.split(","):
        measure_streams(("network",))
    plot(json.loads(OUT.read_text()))


def measure_streams(views) -> None:
    memory = []
    for view in views:
        for length in (1_000, 10_000, 100_000):
            command = [sys.executable, __file__, "--stream-length", str(length), "--stream-view", view]
            run = subprocess.run(command, capture_output=True, text=True, check=True)
            memory.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(memory[-1], flush=True)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    results["stream_memory"] = memory
    OUT.write_text(json.dumps(results, indent=1))


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for name in ("folded", "windowed"):
        if name in results:
            points = sorted((int(k), v) for k, v in results[name]["accuracy"].items())
            axis.plot(*zip(*points), "o-", label=f"{name} ({results[name]['parameters']:,} parameters)")
    axis.axhline(1 / TASK.keys, color="grey", linestyle=":", label="chance")
    axis.set_xscale("log")
    axis.set_xlabel("distance from key to query (tokens)")
    axis.set_ylabel("recall accuracy")
    axis.set_title("Long-range recall, window 12")
    axis.legend()
    figure.tight_layout()
    figure.savefig(OUT.with_suffix(".png"), dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
