"""inference.Exact (against enumeration in float64) and MeanField (ELBO <= log Z, padding, fused
vs naive, bf16)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import close
from benchmarks.reliability.harness import Case


def random_crf(rng, scale: float = 1.0, topology: str | None = None):
    from graphs import CRF

    torch.manual_seed(rng.randrange(2**31))
    crf = CRF(
        vocab_size=6,
        labels=rng.choice([2, 3]),
        channels=rng.choice([1, 2]),
        rank=rng.choice([1, 2]),
        global_labels=rng.choice([0, 0, 2]),
        topology=topology or rng.choice(["full", "causal()", "window(1)", "star()", "root()"]),
        gamma=rng.choice([0, 1, 3]),
    )
    with torch.no_grad():
        for param in crf.parameters():
            param.mul_(scale)
    return crf


def brute_force_log_partition(crf, tokens: torch.Tensor) -> float | None:
    """log Z of one unpadded sentence by enumerating every assignment in float64 through
    ``crf.log_potential`` (independent of Exact's elimination); None when too many."""
    import copy
    import itertools

    crf = copy.deepcopy(crf).double()
    n = tokens.shape[1]
    N = crf.topology.num_nodes(n)
    arcs = crf.arc_mask(torch.ones(1, n, dtype=torch.bool))[0]  # [N, N]
    heads = [arcs[node].nonzero().flatten().tolist() or [0] for node in range(N)]
    count = crf.labels**N * math.prod(len(h) for h in heads) ** crf.channels * max(crf.global_labels, 1) ** n
    if count > 6000:
        return None
    zs = torch.tensor(list(itertools.product(range(crf.labels), repeat=N)))
    hs = torch.tensor(list(itertools.product(*(heads * crf.channels)))).view(-1, crf.channels, N)
    gs = torch.tensor(list(itertools.product(range(crf.global_labels), repeat=n))) if crf.global_labels else None
    z = zs.repeat_interleave(len(hs) * (len(gs) if gs is not None else 1), 0)
    h = hs.repeat_interleave(len(gs) if gs is not None else 1, 0).repeat(len(zs), 1, 1)
    g = gs.repeat(len(zs) * len(hs), 1) if gs is not None else None
    with torch.no_grad():
        scores = crf.log_potential(tokens.expand(len(z), n), z, h, g)
    return float(scores.logsumexp(0))


def exact_cases(rng, count: int, workdir: Path) -> list[Case]:
    from inference import Exact

    cases = []
    for _ in range(count):
        scale = rng.choice([1.0, 1.0, 10.0, 100.0, 1e3, 1e4])
        seed = rng.randrange(2**31)
        n = rng.randint(1, 3)
        tokens = torch.randint(0, 6, (1, n), generator=torch.Generator().manual_seed(seed))
        roll = rng.random()
        crf_rng_state = rng.randrange(2**31)
        make_crf = lambda s=crf_rng_state, scale=scale: random_crf(__import__("random").Random(s), scale)  # noqa: E731
        if roll < 0.55:  # log Z against enumeration in float64

            def run(make_crf=make_crf, tokens=tokens):
                crf = make_crf()
                return {"log_z": Exact(crf).log_partition(tokens), "reference": brute_force_log_partition(crf, tokens)}

            def check(out):
                if out["reference"] is None:
                    return None
                found, ref = float(out["log_z"][0]), out["reference"]
                if not abs(found - ref) <= 1e-4 * max(1.0, abs(ref)) + 1e-3:
                    return "silent wrong", f"log Z {found} but enumeration gives {ref}"
                return None

            cases.append(
                Case(
                    "inference.Exact",
                    f"log Z, potentials x{scale:g}, n={n}",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        elif roll < 0.7:  # padding must not change log Z

            def run(make_crf=make_crf, tokens=tokens, n=n):
                crf = make_crf()
                padded = torch.cat([tokens, torch.randint(0, 6, (1, 2))], 1)
                mask = torch.arange(n + 2)[None] < n
                return {"alone": Exact(crf).log_partition(tokens), "padded": Exact(crf).log_partition(padded, mask)}

            def check(out):
                error = close(out["padded"], out["alone"], 1e-4)
                return None if error <= 1e-4 else ("silent wrong", f"padding changes log Z by {error:.3g}")

            cases.append(
                Case(
                    "inference.Exact",
                    f"padded vs unpadded, x{scale:g}, n={n}",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        else:  # bad input
            label, run, names = rng.choice(
                [
                    (
                        "id = vocab_size",
                        lambda m=make_crf: Exact(m()).log_partition(torch.tensor([[6, 1]])),
                        ("token", "vocab"),
                    ),
                    ("id -1", lambda m=make_crf: Exact(m()).log_partition(torch.tensor([[-1, 1]])), ("token", "vocab")),
                    (
                        "float tokens",
                        lambda m=make_crf: Exact(m()).log_partition(torch.tensor([[1.0, 2.0]])),
                        ("tokens", "dtype", "integer"),
                    ),
                    (
                        "1-D tokens",
                        lambda m=make_crf: Exact(m()).log_partition(torch.tensor([1, 2])),
                        ("tokens", "shape"),
                    ),
                    (
                        "empty tokens",
                        lambda m=make_crf: Exact(m()).log_partition(torch.zeros(1, 0, dtype=torch.long)),
                        ("tokens", "empty"),
                    ),
                    (
                        "all-padding row",
                        lambda m=make_crf: Exact(m()).log_partition(
                            torch.tensor([[1, 2]]), torch.zeros(1, 2, dtype=torch.bool)
                        ),
                        ("mask", "row", "real token"),
                    ),
                    (
                        "too many configurations",
                        lambda m=make_crf: Exact(m(), max_configurations=4).log_partition(torch.tensor([[1, 2, 3]])),
                        ("max_configurations",),
                    ),
                    (
                        "max_configurations=0",
                        lambda m=make_crf: Exact(m(), max_configurations=0),
                        ("max_configurations",),
                    ),
                    (
                        "max_configurations='x'",
                        lambda m=make_crf: Exact(m(), max_configurations="x"),
                        ("max_configurations",),
                    ),
                    ("crf=None", lambda: Exact(None).log_partition(torch.tensor([[1]])), ("crf",)),
                    (
                        "NaN potential",
                        lambda m=make_crf: Exact(_poison(m(), math.nan)).log_partition(torch.tensor([[1, 2]])),
                        ("nan", "finite"),
                    ),
                    (
                        "inf potential",
                        lambda m=make_crf: Exact(_poison(m(), math.inf)).log_partition(torch.tensor([[1, 2]])),
                        ("nan", "inf", "finite"),
                    ),
                ]
            )
            poisoned = "potential" in label
            cases.append(
                Case(
                    "inference.Exact",
                    f"{label} (random CRF #{crf_rng_state % 10**6})",
                    run,
                    names=names,
                    accepted="silent NaN" if poisoned else "silent wrong",
                )
            )
    return cases


def _poison(module, value: float):
    with torch.no_grad():
        next(module.parameters()).view(-1)[0] = value
    return module


def mean_field_cases(rng, count: int, workdir: Path) -> list[Case]:
    from inference import MeanField

    cases = []
    for _ in range(count):
        scale = rng.choice([1.0, 1.0, 10.0, 100.0, 1e3, 1e4])
        state = rng.randrange(2**31)
        make_crf = lambda s=state, scale=scale: random_crf(__import__("random").Random(s), scale)  # noqa: E731
        options = {
            "iterations": rng.choice([1, 3, 8]),
            "schedule": rng.choice(["async", "parallel", "sequential"]),
            "kernel": rng.choice(["naive", "fused"]),
        }
        if options["schedule"] == "sequential":
            options["kernel"] = "naive"  # the fused kernel refuses it (documented)
        roll = rng.random()
        n = rng.randint(1, 3)
        tokens = torch.randint(0, 6, (2, n + 2), generator=torch.Generator().manual_seed(state))
        mask = torch.ones(2, n + 2, dtype=torch.bool)
        mask[1, n:] = False  # row 1 padded
        if roll < 0.6:  # ELBO <= exact log Z (float64 enumeration), finite, padding-invariant

            def run(make_crf=make_crf, options=options, tokens=tokens, mask=mask, n=n):
                crf = make_crf()
                engine = MeanField(crf, **options)
                with torch.no_grad():
                    post = engine(tokens, mask)
                    alone = engine(tokens[1:, :n])
                return {
                    "logits": post.logits,
                    "elbo": post.elbo,
                    "alone_logits": alone.logits,
                    "alone_elbo": alone.elbo,
                    "crf": crf,
                    "tokens": tokens[1:, :n],
                }

            def check(out, n=n):
                log_z = brute_force_log_partition(out["crf"], out["tokens"])  # float64, independent of Exact
                elbo = float(out["alone_elbo"][0])
                if log_z is not None and elbo > log_z + 1e-3 * max(1.0, abs(log_z)):
                    return "silent wrong", f"ELBO {elbo} > exact log Z {log_z} (enumerated in float64)"
                error = close(out["logits"][1:, :n], out["alone_logits"][:, :n], 1e-3)
                if not error <= 1e-3:
                    return "silent wrong", f"padded row's label logits differ from the row alone by {error:.3g}"
                return None

            cases.append(
                Case(
                    "inference.MeanField",
                    f"ELBO <= log Z, padding, x{scale:g}, {options}",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        elif roll < 0.65:  # bf16: both kernels finite (the naive one is the reference)

            def run(make_crf=make_crf, tokens=tokens, mask=mask):
                crf = make_crf().to(torch.bfloat16)
                with torch.no_grad():
                    naive = MeanField(crf, iterations=2, kernel="naive")(tokens, mask).logits
                    fused = MeanField(crf, iterations=2, kernel="fused")(tokens, mask).logits
                return {"naive": naive, "fused": fused}

            cases.append(
                Case(
                    "inference.MeanField",
                    f"bf16, both kernels, x{scale:g}",
                    run,
                    expect="either",
                    names=("dtype", "bfloat16", "bf16"),
                )
            )
        elif roll < 0.75:  # fused and naive kernels agree (padded rows, large potentials)

            def run(make_crf=make_crf, tokens=tokens, mask=mask, iterations=options["iterations"]):
                crf = make_crf()
                with torch.no_grad():
                    naive = MeanField(crf, iterations=iterations, kernel="naive")(tokens, mask).logits
                    fused = MeanField(crf, iterations=iterations, kernel="fused")(tokens, mask).logits
                    double = __import__("copy").deepcopy(crf).double()
                    reference = MeanField(double, iterations=iterations, kernel="naive")(tokens, mask).logits
                return {"naive": naive, "fused": fused, "reference": reference}

            def check(out):
                # the float64 naive kernel is the reference; the float32 naive one stays within
                # ~1e-5 of it at every scale tried (potentials to x1e3), so 1e-3 is generous
                fused, naive = close(out["fused"], out["reference"], 0), close(out["naive"], out["reference"], 0)
                if not fused <= 1e-3:
                    return (
                        "silent wrong",
                        f"fused differs from the float64 naive kernel by {fused:.3g} (float32 naive: {naive:.3g})",
                    )
                return None

            cases.append(
                Case(
                    "inference.MeanField",
                    f"fused vs naive, x{scale:g}, {options['iterations']} iterations",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        else:
            label, kwargs, names = rng.choice(
                [
                    ("iterations=0", {"iterations": 0}, ("iterations",)),
                    ("iterations=-1", {"iterations": -1}, ("iterations",)),
                    ("iterations=2.5", {"iterations": 2.5}, ("iterations",)),
                    ("iterations=10**9", {"iterations": 10**9}, ("iterations",)),
                    ("schedule='bogus'", {"schedule": "bogus"}, ("schedule",)),
                    ("kernel='bogus'", {"kernel": "bogus"}, ("kernel",)),
                    ("dropout=1.5", {"dropout": 1.5}, ("dropout",)),
                    ("dropout=nan", {"dropout": math.nan}, ("dropout",)),
                    ("damping=nan", {"damping": math.nan}, ("damping",)),
                    ("damping=2", {"damping": 2.0}, ("damping",)),
                    ("step_size=inf", {"step_size": math.inf}, ("step_size",)),
                    ("step_size=-1", {"step_size": -1.0}, ("step_size",)),
                    ("weights='bogus'", {"weights": "bogus"}, ("weights",)),
                    ("halting='bogus'", {"halting": "bogus"}, ("halting",)),
                    ("exit_threshold=nan", {"exit_threshold": math.nan}, ("exit_threshold",)),
                ]
            )
            non_finite = any(isinstance(v, float) and not math.isfinite(v) for v in kwargs.values())

            def run(make_crf=make_crf, kwargs=kwargs, tokens=tokens, mask=mask):
                with torch.no_grad():
                    return MeanField(make_crf(), **kwargs)(tokens, mask).logits

            cases.append(
                Case(
                    "inference.MeanField",
                    f"{label} (random CRF #{state % 10**6})",
                    run,
                    names=names,
                    accepted="silent NaN" if non_finite else "silent wrong",
                )
            )
    return cases
