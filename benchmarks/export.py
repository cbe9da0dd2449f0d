"""Export benchmarks (issue: export to plain torch modules, torch.export and ONNX).

    .venv/bin/python benchmarks/export.py

For the small Probabilistic Transformer (configs/pt-small.toml's model, PTB-size
vocabulary), the Particle Transformer (configs/particle-small.toml) and the BERT-style
baseline (configs/bert-small.toml), untrained (export does not depend on the weights):
per format the export time, the artefact size, the largest logit difference from the
source model, and the latency of one padded batch (B = 32, n = 40, min of 5,
interleaved) for the source model, the torch runtime, the ExportedProgram's module and
onnxruntime. torch.set_num_threads(1); onnxruntime with one intra-op thread.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

from probformer.deploy import exporter as deploy  # noqa: E402
from probformer.training import run_config
from probformer.training.checkpoint import MODELS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 10_000


def build(name: str):
    config = run_config.load(ROOT / "configs" / f"{name}.toml")
    model_config = config.model_config(vocab_size=VOCAB, num_classes=0)
    torch.manual_seed(0)
    return MODELS[config.kind][1](model_config).eval()


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def main():
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (32, 40), generator=generator)
    mask = torch.arange(40)[None, :] < torch.randint(5, 41, (32,), generator=generator)[:, None]
    mask[0] = True
    results = {}
    folder = Path(tempfile.mkdtemp())
    for name in ("pt-small", "particle-small", "bert-small"):
        model = build(name)
        callables, row = {"source": lambda m=model: m(tokens, mask)[0]}, {}
        with torch.no_grad():
            expected = model(tokens, mask)[0]
        for format, file in (("torch", "torch"), ("exported", "model.pt2"), ("onnx", "model.onnx")):
            start = time.perf_counter()
            path = deploy.export(model, folder / name / file, format=format)
            seconds = time.perf_counter() - start
            artefact = deploy.load(path)
            if format == "onnx":  # one intra-op thread, as torch
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = options.inter_op_num_threads = 1
                artefact.graph = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            with torch.no_grad():
                error = (artefact(tokens, mask) - expected).abs().max().item()
            row[format] = {"export_seconds": seconds, "bytes": size(path), "max_abs_difference": error}
            callables[format] = lambda a=artefact: a(tokens, mask)
        latency = {key: math.inf for key in callables}
        with torch.no_grad():
            for fn in callables.values():
                fn()
            for _ in range(5):
                for key, fn in callables.items():
                    start = time.perf_counter()
                    fn()
                    latency[key] = min(latency[key], time.perf_counter() - start)
        results[name] = {
            "parameters": sum(p.numel() for p in model.parameters() if p is not None),
            "formats": row,
            "latency_ms": {k: 1000 * v for k, v in latency.items()},
        }
        print(name, json.dumps(results[name], indent=1), flush=True)
    out = ROOT / "docs" / "benchmarks" / "export.json"
    out.write_text(json.dumps({"batch": [32, 40], "threads": 1, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
