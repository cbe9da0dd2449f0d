"""The five model configs and constructors, each model's forward (bad shapes, dtypes, ids,
padding, non-finite parameters) and the PT on other topologies and kernels."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import (
    _CACHE,
    KINDS,
    VOCAB,
    classes,
    combined_expectation,
    forward,
    fresh_model,
    logits_of,
    mutations,
    padding_oracle,
    random_batch,
    tiny_model,
)
from benchmarks.reliability.harness import Case


def config_fields(kind: str):
    import dataclasses
    import typing

    config_cls, _ = classes(kind)
    hints = typing.get_type_hints(config_cls)
    found = []
    for f in dataclasses.fields(config_cls):
        hint = hints[f.name]
        label = hint.__name__ if isinstance(hint, type) else "str"
        found.append((f.name, label, None if f.default is dataclasses.MISSING else f.default))
    return found


def build_and_run(kind: str, values: dict, through_dict: bool):
    config_cls, model_cls = classes(kind)
    config = config_cls.from_dict(values) if through_dict else config_cls(**values)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    vocab = config.vocab_size
    tokens = torch.randint(0, max(vocab, 1), (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return logits_of(forward(model, tokens, mask))


def config_cases(rng, kind: str, count: int) -> list[Case]:
    fields = config_fields(kind)
    entry = f"{KINDS[kind][1]} / {KINDS[kind][2]}"
    cases = []
    for number in range(count):
        values = dict(KINDS[kind][3])
        verdicts = {}
        for _ in range(rng.choice([0, 1, 1, 1, 2])):
            name, hint, default = rng.choice(fields)
            values[name], verdicts[name] = mutations(rng, name, hint, default)
        expect = combined_expectation(verdicts)
        changed = list(verdicts)  # a refusal may name any of them: an "either" value can be out of range too
        if set(verdicts.values()) == {"refuse"}:
            names = tuple(changed)  # only refusable values: the refusal must name one of them
        else:  # an in-range value may still clash with another key: naming any key is clear
            names = tuple(name for name, _, _ in fields)
        through_dict = number % 2 == 0
        non_finite = any(isinstance(values[n], float) and not math.isfinite(values[n]) for n in changed)
        shown = {n: values[n] for n in verdicts}
        cases.append(
            Case(
                entry,
                f"{'from_dict' if through_dict else 'constructor'} {shown}",
                lambda kind=kind, values=values, through_dict=through_dict: build_and_run(kind, values, through_dict),
                expect=expect,
                names=names,
                accepted="silent NaN" if non_finite else "silent wrong",
            )
        )
    return cases


def forward_cases(rng, kind: str, count: int) -> list[Case]:
    entry = f"{KINDS[kind][2]}.forward"
    cases = []
    model = lambda: tiny_model(kind)  # noqa: E731 - built in the worker, on first use
    for _ in range(count):
        choice = rng.random()
        batch, length = rng.randint(1, 3), rng.randint(1, 10)
        tokens, mask = random_batch(rng, batch, length)
        if choice < 0.35:  # valid, trailing padding: finite and padding-invariant
            cases.append(
                Case(
                    entry,
                    f"valid [{batch}, {length}] padded rows {[int(m.sum()) for m in mask]}",
                    lambda t=tokens, m=mask: forward(model(), t, m),
                    expect="accept",
                    check=lambda out, t=tokens, m=mask: padding_oracle(model(), t, m)(out),
                    finite=False,  # the logits are checked; a trace may hold -inf by design (padded log-weights)
                )
            )
            continue
        if choice < 0.45:
            # A NaN / inf written into a parameter in memory: every forward refuses it by the
            # parameter's name (a device-side check, no host synchronisation while it passes).
            value = rng.choice([float("nan"), float("inf"), float("-inf")])
            names = [name for name, p in tiny_model(kind).named_parameters() if p.dtype.is_floating_point]
            target = names[int(rng.random() * len(names))]

            def run(t=tokens, m=mask, value=value, target=target):
                broken = fresh_model(kind)
                with torch.no_grad():
                    broken.get_parameter(target).view(-1)[0] = value
                return forward(broken, t, m)

            cases.append(
                Case(
                    entry,
                    f"parameter {target}[0] set to {value} in memory",
                    run,
                    names=(target,),
                    accepted="silent NaN",
                )
            )
            continue
        bad = rng.choice(
            [
                ("float tokens", lambda t, m: (t.float(), m), ("tokens", "dtype", "integer")),
                ("1-D tokens", lambda t, m: (t[0], None), ("tokens", "shape")),
                ("3-D tokens", lambda t, m: (t[:, :, None], None), ("tokens", "shape")),
                ("empty batch", lambda t, m: (t[:0], m[:0]), ("tokens", "empty", "batch")),
                ("zero length", lambda t, m: (t[:, :0], m[:, :0]), ("tokens", "empty", "length")),
                ("id -1", lambda t, m: (t.index_fill(1, torch.tensor([0]), -1), m), ("token", "vocab_size")),
                (
                    "id = vocab_size",
                    lambda t, m: (t.index_fill(1, torch.tensor([0]), VOCAB), m),
                    ("token", "vocab_size"),
                ),
                ("id 10**12", lambda t, m: (t.index_fill(1, torch.tensor([0]), 10**12), m), ("token", "vocab_size")),
                (
                    "all-padding row",
                    lambda t, m: (t, m.index_fill(0, torch.tensor([0]), False)),
                    ("row", "real token", "mask"),
                ),
                ("int mask", lambda t, m: (t, m.long()), ("mask",)),
                ("float mask", lambda t, m: (t, m.float()), ("mask",)),
                ("mask of the wrong shape", lambda t, m: (t, m[:, :-1] if m.shape[1] > 1 else m[:, :0]), ("mask",)),
                (
                    "transposed mask",
                    lambda t, m: (t, torch.ones(m.shape[1], m.shape[0] + 1, dtype=torch.bool)),
                    ("mask",),
                ),
                (
                    "length 100 > max_length",
                    lambda t, m: (torch.randint(0, VOCAB, (1, 100)), None),
                    ("max_length", "length"),
                ),
                ("list tokens", lambda t, m: (t.tolist(), None), ("tokens",)),
                ("numpy tokens", lambda t, m: (t.numpy(), None), ("tokens",)),
            ]
        )
        label, make, names = bad
        expect = "either" if label in ("list tokens", "numpy tokens") else "refuse"
        if label == "length 100 > max_length" and kind in ("probabilistic_transformer", "folded_context"):
            expect = "either"  # no max_length in these configs: a long input is valid
        cases.append(
            Case(
                entry,
                f"{label} (from [{batch}, {length}])",
                lambda make=make, t=tokens, m=mask: forward(model(), *make(t, m)),
                expect=expect,
                names=names,
            )
        )
    return cases


PT_VARIANTS = {  # name -> (PT config changes, parameter scale): padding must never matter
    "clusters(2)": ({"topology": "clusters(2)"}, 1.0),
    "clusters(3) dynamic": ({"topology": "clusters(3, True)"}, 1.0),
    "star()": ({"topology": "star()"}, 1.0),
    "window(2) | root()": ({"topology": "window(2) | root()"}, 1.0),
    "causal()": ({"topology": "causal()"}, 1.0),
    "fused kernel, potentials x10": ({"kernel": "fused"}, 10.0),
    "fused kernel, potentials x100": ({"kernel": "fused"}, 100.0),
    "naive kernel, potentials x100": ({"kernel": "naive"}, 100.0),
    "global labels, parallel": ({"global_labels": 4, "schedule": "parallel"}, 1.0),
}


def pt_variant(name: str):
    if ("pt", name) not in _CACHE:
        from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig

        changes, scale = PT_VARIANTS[name]
        torch.manual_seed(0)
        model = ProbabilisticTransformer(PTConfig(**(KINDS["probabilistic_transformer"][3] | changes))).eval()
        with torch.no_grad():
            for param in model.crf.parameters() if hasattr(model, "crf") else model.parameters():
                param.mul_(scale)
        _CACHE["pt", name] = model
    return _CACHE["pt", name]


def tolerance(variant: str) -> float:
    """float32 rounding grows with the potentials: 1e-4 relative per unit of scale (the
    padding effects this catches are >= 0.04; the kernels' accuracy is checked in engines)."""
    return 1e-4 * max(1.0, PT_VARIANTS[variant][1])


def pt_variant_cases(rng, count: int, workdir: Path) -> list[Case]:
    """The PT on other topologies and kernels, at larger potentials: finite and padding-invariant."""
    cases = []
    for _ in range(count):
        name = rng.choice(sorted(PT_VARIANTS))
        batch, length = rng.randint(1, 3), rng.randint(1, 10)
        tokens, mask = random_batch(rng, batch, length)
        cases.append(
            Case(
                "ProbabilisticTransformer.forward (topologies, kernels)",
                f"{name}: [{batch}, {length}] padded rows {mask.sum(1).tolist()}",
                lambda name=name, t=tokens, m=mask: forward(pt_variant(name), t, m),
                expect="accept",
                check=lambda out, name=name, t=tokens, m=mask: padding_oracle(pt_variant(name), t, m, tolerance(name))(
                    out
                ),
                finite=False,
            )
        )
    return cases
