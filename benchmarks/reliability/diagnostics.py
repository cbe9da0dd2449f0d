"""probformer.diagnostics: ess (against float64), pareto_k (shift invariance), diversity
(equal tokens, padding content) and report (every model kind, length 1, padding)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import KINDS, VOCAB, close, random_batch, tiny_model
from benchmarks.reliability.harness import Case, nonfinite


def ess_reference(log_weights: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / sum w^2 along the last axis, in float64 from the given values."""
    lw = log_weights.double()
    lw = lw - lw.amax(-1, keepdim=True)
    w = lw.exp()
    return w.sum(-1) ** 2 / (w**2).sum(-1)


def ess_cases(rng, count: int, workdir: Path) -> list[Case]:
    from probformer import diagnostics

    cases = []
    for _ in range(count):
        dtype = rng.choice([torch.float32, torch.float64])
        size, batch = rng.choice([1, 2, 3, 10, 1000]), rng.randint(1, 3)
        offset = rng.choice([0.0, -50.0, 80.0, -700.0, 1e4, -1e4])
        spread = rng.choice([0.0, 0.0, 1e-3, 1.0, 30.0])
        seed = rng.randrange(2**31)
        lw = (
            offset
            + spread * torch.randn(batch, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        ).to(dtype)
        roll = rng.random()
        if roll < 0.55:
            use_log = offset not in (80.0, 1e4) or rng.random() < 0.5  # exp(1e4) overflows: log form only

            def run(lw=lw, use_log=use_log):
                if use_log:
                    return diagnostics.ess(log_weights=lw)
                return diagnostics.ess((lw.double() - lw.double().amax(-1, keepdim=True)).exp().to(lw.dtype))

            def check(found, lw=lw, spread=spread, size=size):
                expected = ess_reference(lw)
                equal = bool((lw == lw[..., :1]).all())
                tolerance = 1e-6 if equal else (2e-3 if lw.dtype == torch.float32 else 1e-9)
                error = close(found, expected, tolerance)
                if not error <= tolerance:
                    what = "equal weights" if equal else "weights"
                    return (
                        "silent wrong",
                        f"ESS of {what} {found.flatten()[:3].tolist()} != {expected.flatten()[:3].tolist()}",
                    )
                return None

            form = "log_weights" if use_log else "weights"
            label = f"{form} {dtype} [{batch}, {size}] offset {offset:g} spread {spread:g}"
            cases.append(Case("probformer.diagnostics.ess", label, run, expect="accept", check=check))
        else:
            label, run, names, non_finite = rng.choice(
                [
                    (
                        "NaN log weight",
                        lambda lw=lw: diagnostics.ess(log_weights=lw.index_fill(-1, torch.tensor([0]), math.nan)),
                        ("nan", "log_weights"),
                        True,
                    ),
                    (
                        "+inf log weight",
                        lambda lw=lw: diagnostics.ess(log_weights=lw.index_fill(-1, torch.tensor([0]), math.inf)),
                        ("inf", "log_weights"),
                        True,
                    ),
                    (
                        "all -inf log weights",
                        lambda lw=lw: diagnostics.ess(log_weights=torch.full_like(lw, -math.inf)),
                        ("-inf", "log_weights"),
                        True,
                    ),
                    (
                        "negative weight",
                        lambda lw=lw: diagnostics.ess(-lw.exp().clamp(min=1e-3)),
                        ("weights", "negative"),
                        False,
                    ),
                    (
                        "inf weight",
                        lambda lw=lw: diagnostics.ess(torch.full_like(lw, math.inf)),
                        ("weights", "finite"),
                        True,
                    ),
                    ("zero weights", lambda lw=lw: diagnostics.ess(torch.zeros_like(lw)), ("weights", "zero"), False),
                    ("empty", lambda: diagnostics.ess(torch.zeros(0)), ("weights", "empty"), False),
                    (
                        "both arguments",
                        lambda lw=lw: diagnostics.ess(lw.exp(), log_weights=lw),
                        ("weights", "log_weights"),
                        False,
                    ),
                    ("no argument", lambda: diagnostics.ess(), ("weights", "log_weights"), False),
                    ("dim out of range", lambda lw=lw: diagnostics.ess(log_weights=lw, dim=5), ("dim",), False),
                    ("strings", lambda: diagnostics.ess(["a", "b"]), ("weights",), False),
                ]
            )
            cases.append(
                Case(
                    "probformer.diagnostics.ess",
                    f"{label} (from {dtype} [{batch}, {size}])",
                    run,
                    names=names,
                    accepted="silent NaN" if non_finite else "silent wrong",
                )
            )
    return cases


def pareto_cases(rng, count: int, workdir: Path) -> list[Case]:
    from probformer import diagnostics

    cases = []
    for _ in range(count):
        draws, batch = rng.choice([5, 21, 50, 400]), rng.randint(1, 3)
        shift = rng.choice([0.0, 5.0, -300.0, 1e3])
        seed = rng.randrange(2**31)
        g = torch.Generator().manual_seed(seed)
        lw = rng.choice([1.0, 3.0]) * torch.randn(batch, draws, generator=g, dtype=torch.float64)
        if rng.random() < 0.15:
            lw = torch.zeros(batch, draws, dtype=torch.float64)
        if rng.random() < 0.6:

            def run(lw=lw, shift=shift):
                return {"k": diagnostics.pareto_k(lw).k, "shifted": diagnostics.pareto_k(lw + shift).k}

            def check(out, lw=lw, draws=draws):
                import numpy as np

                k, shifted = np.asarray(out["k"]), np.asarray(out["shifted"])
                if draws >= diagnostics.MIN_PSIS_DRAWS and not np.all(np.isfinite(k) | np.isneginf(k)):
                    return "silent NaN", f"k-hat {k.tolist()} not finite for {draws} draws"
                both = np.isfinite(k) & np.isfinite(shifted)
                if not np.array_equal(np.isfinite(k), np.isfinite(shifted)) or not np.allclose(
                    k[both], shifted[both], atol=1e-6
                ):
                    return (
                        "silent wrong",
                        f"k-hat changes when every log weight is shifted: {k.tolist()} vs {shifted.tolist()}",
                    )
                return None

            cases.append(
                Case(
                    "probformer.diagnostics.pareto_k",
                    f"[{batch}, {draws}] shift {shift:g}",
                    run,
                    expect="accept",
                    check=check,
                    finite=False,
                )
            )
        else:
            label, run, names, non_finite = rng.choice(
                [
                    (
                        "NaN",
                        lambda lw=lw: diagnostics.pareto_k(lw.index_fill(-1, torch.tensor([0]), math.nan)),
                        ("nan",),
                        True,
                    ),
                    (
                        "+inf",
                        lambda lw=lw: diagnostics.pareto_k(lw.index_fill(-1, torch.tensor([0]), math.inf)),
                        ("inf",),
                        True,
                    ),
                    ("all -inf", lambda lw=lw: diagnostics.pareto_k(torch.full_like(lw, -math.inf)), ("-inf",), True),
                    ("empty", lambda: diagnostics.pareto_k(torch.zeros(2, 0)), ("log_weights", "empty"), False),
                    ("0-d", lambda: diagnostics.pareto_k(torch.tensor(0.5)), ("log_weights", "shape", "dim"), False),
                    ("strings", lambda: diagnostics.pareto_k(["a"]), ("log_weights",), False),
                    (
                        "relative_efficiency=0",
                        lambda lw=lw: diagnostics.pareto_k(lw, relative_efficiency=0.0),
                        ("relative_efficiency",),
                        False,
                    ),
                    (
                        "relative_efficiency=nan",
                        lambda lw=lw: diagnostics.pareto_k(lw, relative_efficiency=math.nan),
                        ("relative_efficiency",),
                        True,
                    ),
                ]
            )
            cases.append(
                Case(
                    "probformer.diagnostics.pareto_k",
                    f"{label} (from [{batch}, {draws}])",
                    run,
                    names=names,
                    accepted="silent NaN" if non_finite else "silent wrong",
                )
            )
    return cases


def diversity_cases(rng, count: int, workdir: Path) -> list[Case]:
    from probformer import diagnostics

    cases = []
    for _ in range(count):
        batch, length, width = rng.randint(1, 3), rng.randint(1, 8), rng.choice([1, 4, 16])
        seed = rng.randrange(2**31)
        hidden = torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed)) * rng.choice(
            [1e-20, 1.0, 1e20]
        )
        tokens_, mask = random_batch(rng, batch, length)
        roll = rng.random()
        if roll < 0.35:  # every real token equal: cosine 1, distance 0, effective rank 1

            def run(hidden=hidden, mask=mask):
                same = hidden[:, :1].expand_as(hidden).clone()
                return diagnostics.diversity(same, mask)

            def check(out, mask=mask):
                two = mask.sum(1) >= 2
                if not torch.allclose(
                    out.cosine[two].double(), torch.ones(int(two.sum()), dtype=torch.float64), atol=1e-5
                ):
                    return "silent wrong", f"cosine of equal tokens {out.cosine.tolist()} != 1"
                if not torch.allclose(
                    out.rank_one_distance.double(), torch.zeros(len(mask), dtype=torch.float64), atol=1e-5
                ):
                    return "silent wrong", f"distance of equal tokens {out.rank_one_distance.tolist()} != 0"
                if not torch.allclose(
                    out.effective_rank.double(), torch.ones(len(mask), dtype=torch.float64), atol=1e-5
                ):
                    return "silent wrong", f"effective rank of equal tokens {out.effective_rank.tolist()} != 1"
                return None

            cases.append(
                Case(
                    "probformer.diagnostics.diversity",
                    f"equal tokens [{batch}, {length}, {width}]",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        elif roll < 0.6:  # padding content must not matter

            def run(hidden=hidden, mask=mask):
                garbage = torch.where(mask[..., None], hidden, torch.full_like(hidden, 1e3))
                return {
                    "clean": diagnostics.diversity(hidden * mask[..., None], mask),
                    "garbage": diagnostics.diversity(garbage, mask),
                }

            def check(out):
                for name in ("cosine", "effective_rank", "rank_one_distance"):
                    error = close(getattr(out["garbage"], name), getattr(out["clean"], name), 1e-6)
                    if not error <= 1e-6:
                        return "silent wrong", f"{name} depends on the padded tokens' values ({error:.3g})"
                return None

            cases.append(
                Case(
                    "probformer.diagnostics.diversity",
                    f"padding content [{batch}, {length}, {width}]",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        else:
            label, run, names, non_finite = rng.choice(
                [
                    ("2-D hidden", lambda h=hidden: diagnostics.diversity(h[0]), ("hidden", "shape"), False),
                    (
                        "NaN hidden",
                        lambda h=hidden: diagnostics.diversity(h.index_fill(1, torch.tensor([0]), math.nan)),
                        ("hidden", "nan"),
                        True,
                    ),
                    (
                        "inf hidden",
                        lambda h=hidden: diagnostics.diversity(h.index_fill(1, torch.tensor([0]), math.inf)),
                        ("hidden", "inf"),
                        True,
                    ),
                    ("int mask", lambda h=hidden, m=mask: diagnostics.diversity(h, m.long()), ("mask",), False),
                    (
                        "mask of the wrong shape",
                        lambda h=hidden, m=mask: diagnostics.diversity(h, m[:, :-1]),
                        ("mask",),
                        False,
                    ),
                    (
                        "all-padding row",
                        lambda h=hidden, m=mask: diagnostics.diversity(h, torch.zeros_like(m)),
                        ("mask", "real token"),
                        False,
                    ),
                    ("empty", lambda: diagnostics.diversity(torch.zeros(0, 3, 4)), ("hidden", "empty"), False),
                ]
            )
            cases.append(
                Case(
                    "probformer.diagnostics.diversity",
                    f"{label} (from [{batch}, {length}, {width}])",
                    run,
                    names=names,
                    accepted="silent NaN" if non_finite else "silent wrong",
                )
            )
    return cases


def report_cases(rng, count: int, workdir: Path) -> list[Case]:
    from probformer import diagnostics

    cases = []
    for _ in range(count):
        kind = rng.choice(sorted(KINDS))
        batch, length = rng.randint(1, 3), rng.choice([1, 1, 2, 5, 9])
        tokens, mask = random_batch(rng, batch, length)

        def run(kind=kind, tokens=tokens, mask=mask):
            data = diagnostics.report(tiny_model(kind), tokens, mask)
            # diversity is always there and always measurable; ESS and k-hat may be NaN by
            # design (nothing to measure: no head, too few draws), so only their range is checked
            stats = data["sample_stats"]
            found = {name: stats[name].values for name in ("cosine", "effective_rank", "rank_one_distance")}
            return found, {k: stats[k].values for k in ("query_ess", "received_ess", "smc_ess") if k in stats}

        def check(out):
            import numpy as np

            found = nonfinite(out[0])
            if found:
                return "silent NaN", f"diversity not finite: {found}"
            for name, values in out[1].items():
                finite = values[np.isfinite(values)]
                if ((finite <= 0) | (finite > 1 + 1e-9)).any():
                    return "silent wrong", f"normalised ESS {name} outside (0, 1]: {finite.tolist()[:4]}"
            return None

        cases.append(
            Case(
                "probformer.diagnostics.report",
                f"{kind} [{batch}, {length}] rows {mask.sum(1).tolist()}",
                run,
                expect="accept",
                check=check,
                finite=False,
            )
        )
    for label, run, names in [
        (
            "not a model",
            lambda: diagnostics.report(torch.nn.Linear(2, 2), torch.tensor([[1, 2]])),
            ("Linear", "diagnostic_trace"),
        ),
        (
            "id = vocab_size",
            lambda: diagnostics.report(tiny_model("transformer"), torch.tensor([[1, VOCAB]])),
            ("token", "vocab_size"),
        ),
        (
            "mask of the wrong shape",
            lambda: diagnostics.report(
                tiny_model("transformer"), torch.tensor([[1, 2]]), torch.ones(1, 3, dtype=torch.bool)
            ),
            ("mask",),
        ),
        (
            "all-padding row",
            lambda: diagnostics.report(
                tiny_model("probabilistic_transformer"), torch.tensor([[1, 2]]), torch.zeros(1, 2, dtype=torch.bool)
            ),
            ("row", "real token", "mask"),
        ),
        (
            "float tokens",
            lambda: diagnostics.report(tiny_model("particle_transformer"), torch.ones(1, 3)),
            ("tokens", "dtype", "integer"),
        ),
    ]:
        cases.append(Case("probformer.diagnostics.report", label, run, names=names))
    return cases
