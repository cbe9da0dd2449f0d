"""Export benchmarks: every model kind to the torch folder, torch.export (.pt2) and ONNX.

    .venv/bin/python benchmarks/export.py            # writes docs/benchmarks/export.json
    .venv/bin/python benchmarks/export.py --quick    # tiny batch, vocabulary 500, one run; writes nothing

Untrained models (export does not depend on the weights), vocabulary 10,000, built from
configs/pt-small.toml (Probabilistic Transformer), configs/particle-small.toml,
configs/bert-small.toml (BERT-style baseline), configs/variants/swarm-contiguous.toml
(SwarmFormer) and configs/variants/folded-lm.toml (FoldedContext, traced with
``max_length`` = the batch's length; the default, 512, would pad every input to 513
positions). Per format: the export time (it includes export's own check: load the
artefact and compare it with the source), the artefact size, the largest logit
difference from the source model, and the latency of one padded batch (B = 32, n = 40,
min of 5, interleaved) for the source model in eval mode and for what
``probformer.load`` returns (the torch folder: the trainable class rebuilt from config
and weights; .pt2: the ExportedProgram's module behind input checks; ONNX: an
onnxruntime session behind input checks). torch.set_num_threads(1); onnxruntime with
one intra-op thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

import probformer  # noqa: E402
from probformer.models import registry  # noqa: E402
from probformer.training import run_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "pt-small": "pt-small.toml",
    "particle-small": "particle-small.toml",
    "bert-small": "bert-small.toml",
    "swarm-contiguous": "variants/swarm-contiguous.toml",
    "folded-lm": "variants/folded-lm.toml",
}
FILES = {"torch": "torch", "exported": "model.pt2", "onnx": "model.onnx"}


def build(name: str, vocabulary: int):
    config = run_config.load(ROOT / "configs" / CONFIGS[name])
    model_config = config.model_config(vocab_size=vocabulary, num_classes=0)
    torch.manual_seed(0)
    return registry.build(config.kind, model_config.to_dict()).eval()


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def one_thread_onnx(artefact, path: Path):
    """The loaded ONNX wrapper with its session replaced by a one-thread session, as torch."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    artefact.run = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return artefact


def measure(name: str, tokens, mask, folder: Path, vocabulary: int, repeats: int) -> dict:
    model = build(name, vocabulary)
    max_length = tokens.shape[1] if registry.kind_of(model) == "folded_context" else None
    callables, row = {"source": lambda: model(tokens, mask)[0]}, {}
    with torch.no_grad():
        expected = model(tokens, mask)[0]
    for format, file in FILES.items():
        path = folder / name / file
        start = time.perf_counter()
        probformer.export(model, path, format=format, max_length=max_length)
        seconds = time.perf_counter() - start
        artefact = probformer.load(path)
        if format == "onnx":
            artefact = one_thread_onnx(artefact, path)
        with torch.no_grad():
            error = (artefact(tokens, mask) - expected).abs().max().item()
        row[format] = {"export_seconds": seconds, "bytes": size(path), "max_abs_difference": error}
        callables[format] = lambda a=artefact: a(tokens, mask)
    latency = {key: math.inf for key in callables}
    with torch.no_grad():
        for fn in callables.values():
            fn()
        for _ in range(repeats):
            for key, fn in callables.items():
                start = time.perf_counter()
                fn()
                latency[key] = min(latency[key], time.perf_counter() - start)
    return {
        "kind": registry.kind_of(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "formats": row,
        "latency_ms": {k: 1000 * v for k, v in latency.items()},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 4 x 12, vocabulary 500, one run; no json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch, length, vocabulary, repeats = (4, 12, 500, 1) if args.quick else (32, 40, 10_000, 5)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocabulary, (batch, length), generator=generator)
    mask = torch.arange(length)[None, :] < torch.randint(5, length + 1, (batch,), generator=generator)[:, None]
    mask[0] = True
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in CONFIGS:
            results[name] = measure(name, tokens, mask, Path(folder), vocabulary, repeats)
            print(name, json.dumps(results[name], indent=1), flush=True)
    if not args.quick:
        out = ROOT / "docs" / "benchmarks" / "export.json"
        record = {"batch": [batch, length], "vocabulary": vocabulary, "threads": 1, "torch": torch.__version__}
        out.write_text(json.dumps({**record, "results": results}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
