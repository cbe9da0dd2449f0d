"""What many case families share: tiny models of the five kinds, batches, tolerances, the
padding oracle, config-value mutations and the pickle payload that proves code ran."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.harness import nonfinite

KINDS = {  # entry-point name -> (config module, config class, model class, a tiny valid config)
    "probabilistic_transformer": (
        "probabilistic_transformer",
        "PTConfig",
        "ProbabilisticTransformer",
        {"vocab_size": 20, "labels": 8, "channels": 2, "rank": 4, "iterations": 2, "dropout": 0.0},
    ),
    "particle_transformer": (
        "particle_transformer",
        "ParticleConfig",
        "ParticleTransformer",
        {"vocab_size": 20, "width": 16, "heads": 2, "layers": 2, "ffn_width": 32, "max_length": 32, "dropout": 0.0},
    ),
    "transformer": (
        "baselines",
        "TransformerConfig",
        "Transformer",
        {"vocab_size": 20, "width": 16, "heads": 2, "layers": 2, "ffn_width": 32, "max_length": 32, "dropout": 0.0},
    ),
    "swarmformer": (
        "swarmformer",
        "SwarmConfig",
        "SwarmFormer",
        {
            "vocab_size": 20,
            "width": 16,
            "heads": 2,
            "layers": 2,
            "ffn_width": 32,
            "clusters": 2,
            "max_length": 32,
            "dropout": 0.0,
        },
    ),
    "folded_context": (
        "folded_context",
        "FoldedContextConfig",
        "FoldedContext",
        {
            "vocab_size": 20,
            "width": 16,
            "heads": 2,
            "local_layers": 1,
            "global_layers": 1,
            "ffn_width": 32,
            "segment": 4,
        },
    ),
}

VOCAB = 20

_CACHE: dict = {}


def classes(kind: str):
    import importlib

    module, config_name, model_name, _ = KINDS[kind]
    found = importlib.import_module(f"probformer.models.{module}")
    return getattr(found, config_name), getattr(found, model_name)


def tiny_model(kind: str, seed: int = 0):
    """A small model of ``kind`` in eval mode, built once per worker (never mutate it)."""
    if (kind, seed) not in _CACHE:
        config_cls, model_cls = classes(kind)
        torch.manual_seed(seed)
        _CACHE[kind, seed] = model_cls(config_cls(**KINDS[kind][3])).eval()
    return _CACHE[kind, seed]


def fresh_model(kind: str, seed: int = 0):
    import copy

    return copy.deepcopy(tiny_model(kind, seed))


def logits_of(output):
    return output[0] if isinstance(output, tuple) else output


def forward(model, tokens, mask=None):
    with torch.no_grad():
        return model(tokens, mask)


def random_batch(rng, batch: int, length: int, vocab: int = VOCAB, padded: bool = True):
    """Token ids and a trailing-padding mask (every row keeps >= 1 real token)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    lengths = [rng.randint(1, length) if padded else length for _ in range(batch)]
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return tokens, mask


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> float:
    """The largest |a - b| / (1 + |b|) (0.0 when the shapes agree and both are equal)."""
    if a.shape != b.shape:
        return math.inf
    return float(((a.double() - b.double()).abs() / (1 + b.double().abs())).max()) if a.numel() else 0.0


def padding_oracle(model, tokens, mask, tolerance: float = 1e-4):
    """An oracle: each padded row's logits on its real tokens equal the logits of that
    row alone, unpadded (trailing padding must not change anything)."""

    def check(output):
        logits = logits_of(output)
        found = nonfinite(logits)
        if found:
            return "silent NaN", f"logits: {found}"
        for row in range(tokens.shape[0]):
            length = int(mask[row].sum())
            alone = logits_of(forward(model, tokens[row : row + 1, :length]))
            error = close(logits[row : row + 1, :length], alone, tolerance)
            if not error <= tolerance:
                return (
                    "silent wrong",
                    f"row {row} (length {length} of {tokens.shape[1]}) differs from the row alone by {error:.3g}",
                )
        return None

    return check


CHOICES = {  # known-valid alternatives of string keys ("either": they may still clash with others)
    "topology": ["full", "causal()", "window(2)", "star()", "clusters(2)", "root()", "window(1) | star()"],
    "schedule": ["async", "parallel", "sequential", "macaron"],
    "kernel": ["auto", "naive", "fused"],
    "task": ["mlm", "tagging", "classification"],
    "pooling": ["mean", "root"],
    "halting": ["none", "act", "exit"],
    "halting_source": ["posterior", "delta"],
    "ternary_form": ["low_rank", "cp", "tucker"],
    "global_memory": ["dense", "product_key"],
    "mup_paradigm": ["channels", "labels"],
    "resampling": ["straight-through", "gumbel-softmax", "multinomial", "systematic"],
    "norm": ["pre", "post"],
    "routing": ["gumbel", "contiguous"],
    "weights": ["reference", "crf", {}],
}

# keys where a huge value allocates nothing (a span, a window, a reference width): not absurd
HARMLESS_HUGE = {
    "mup_base_width",
    "span_max",
    "span_ramp",
    "memory_topk",
    "window",
    "segment",
    "local_rounds",
    "ternary_blocks",
}

FLOAT_RANGES = {  # float keys whose range is documented (configs' checks, docs/api.md)
    "dropout": lambda v: 0 <= v < 1,
    "ess_threshold": lambda v: 0 <= v <= 1,
    "temperature": lambda v: v > 0,
    "top_p": lambda v: 0 < v <= 1,
}


def mutations(rng, name: str, hint: str, default):
    """(value, expect) for one config key: wrong types and non-finite or absurd values
    must be refused; in-range values may be accepted."""
    if hint == "int":
        refuse = [-1, "3", 2.5, True, None, float("nan")] + ([] if name in HARMLESS_HUGE else [10**12])
        either = [0, 1, 2, 3, 4, 8] + ([10**12] if name in HARMLESS_HUGE else [])
    elif hint == "float":
        refuse = [float("nan"), float("inf"), float("-inf"), "0.1", None]
        either = [-1.0, 0.0, 0.5, 1.0, 2.0, 1e-9, 1e9]
        if name in FLOAT_RANGES:  # documented ranges: a value outside is refusable too
            inside = FLOAT_RANGES[name]
            value = rng.choice(either)
            return value, "either" if inside(value) else "refuse"
    elif hint == "bool":
        refuse, either = ["yes", 1, None], [True, False]
    else:  # str or str | dict
        refuse = ["bogus", 3, ""] + ([] if name == "topology" else [None])
        either = CHOICES.get(name, [default]) + ([None] if name == "topology" else [])  # graphs.CRF: None is "full"
    if rng.random() < 0.5:
        return rng.choice(refuse), "refuse"
    return rng.choice(either), "either"


def combined_expectation(verdicts: dict[str, str]) -> str:
    """One refusable value makes the whole input refusable; any change makes it "either"."""
    if "refuse" in verdicts.values():
        return "refuse"
    return "either" if verdicts else "accept"


class Payload:
    """Unpickling this creates ``marker``: proof that a file ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload_pickle(marker: str) -> bytes:
    """The pickle, padded with zeros to a multiple of 8 bytes: unpickling stops at its STOP
    opcode, and a loader that first maps the entry as raw tensor bytes (torch.export does
    for constants) must not stumble on a size that no dtype divides."""
    import pickle

    data = pickle.dumps(Payload(marker), protocol=2)
    return data + b"\0" * (-len(data) % 8)


def unrelated_file(workdir: Path) -> Path:
    """A user's file that no probformer call may replace (never a file of this repository)."""
    path = workdir / "unrelated.txt"
    path.write_text("a user's notes\n")
    return path
