"""inference.SMC (equal increments: the evidence is exactly T c and the ESS stays N) and
inference.Gibbs (few cases: NumPyro compiles for tens of seconds)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.engines import random_crf
from benchmarks.reliability.harness import Case


def smc_cases(rng, count: int, workdir: Path) -> list[Case]:
    from inference import SMC

    cases = []
    for _ in range(count):
        particles, steps, batch = rng.choice([1, 2, 7, 64]), rng.randint(0, 6), rng.randint(1, 3)
        resample, threshold = (
            rng.choice(["multinomial", "stratified", "systematic", "residual"]),
            rng.choice([0.0, 0.5, 1.0]),
        )
        relaxation = rng.choice([None, None, "gumbel-softmax", "straight-through"])
        constant = rng.choice([0.0, -3.0, 5.0, -700.0, 1e4])
        seed = rng.randrange(2**31)
        roll = rng.random()
        if roll < 0.6:
            # every particle gets the same increment c: the evidence is exactly T c and the
            # ESS stays N (an oracle that needs no sampling theory)
            def run(
                particles=particles,
                steps=steps,
                batch=batch,
                resample=resample,
                threshold=threshold,
                relaxation=relaxation,
                constant=constant,
                seed=seed,
            ):
                smc = SMC(
                    particles,
                    resample=resample,
                    ess_threshold=threshold,
                    relaxation=relaxation,
                    generator=torch.Generator().manual_seed(seed),
                )
                init = lambda B: torch.randn(B, particles, 2)  # noqa: E731
                step = lambda t, x: (x + 1, torch.full(x.shape[:2], constant))  # noqa: E731
                return smc.filter(init, step, steps, batch_size=batch)

            def check(out, steps=steps, particles=particles, constant=constant):
                expected = steps * constant
                if not torch.allclose(
                    out.log_evidence.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-4
                ):
                    return "silent wrong", f"log evidence {out.log_evidence.tolist()} != T c = {expected}"
                if steps and not torch.allclose(
                    out.ess.double(), torch.tensor(float(particles), dtype=torch.float64), rtol=1e-5
                ):
                    return "silent wrong", f"ESS of equal weights {out.ess.flatten()[:3].tolist()} != N = {particles}"
                return None

            cases.append(
                Case(
                    "inference.SMC",
                    f"equal increments {constant:g}, N={particles}, T={steps}, {resample}, {relaxation}",
                    run,
                    expect="accept",
                    check=check,
                )
            )
        else:
            label, make, names, non_finite = rng.choice(
                [
                    ("num_particles=0", lambda: SMC(0), ("num_particles",), False),
                    ("num_particles=2.5", lambda: SMC(2.5), ("num_particles",), False),
                    ("num_particles='4'", lambda: SMC("4"), ("num_particles",), False),
                    ("num_particles=10**12", lambda: SMC(10**12), ("num_particles",), False),
                    ("resample='bogus'", lambda: SMC(4, resample="bogus"), ("resample",), False),
                    ("ess_threshold=nan", lambda: SMC(4, ess_threshold=math.nan), ("ess_threshold",), True),
                    ("ess_threshold=1.5", lambda: SMC(4, ess_threshold=1.5), ("ess_threshold",), False),
                    ("temperature=0", lambda: SMC(4, temperature=0.0), ("temperature",), False),
                    ("temperature=inf", lambda: SMC(4, temperature=math.inf), ("temperature",), True),
                    ("relaxation='bogus'", lambda: SMC(4, relaxation="bogus"), ("relaxation",), False),
                    (
                        "num_steps=-1",
                        lambda: SMC(4).filter(lambda B: torch.zeros(B, 4), lambda t, x: (x, x), -1),
                        ("num_steps",),
                        False,
                    ),
                    (
                        "NaN increments",
                        lambda: SMC(4).filter(
                            lambda B: torch.zeros(B, 4), lambda t, x: (x, torch.full_like(x, math.nan)), 2
                        ),
                        ("nan",),
                        True,
                    ),
                    (
                        "+inf increments",
                        lambda: SMC(4).filter(
                            lambda B: torch.zeros(B, 4), lambda t, x: (x, torch.full_like(x, math.inf)), 2
                        ),
                        ("inf",),
                        True,
                    ),
                    (
                        "all -inf increments",
                        lambda: SMC(4).filter(
                            lambda B: torch.zeros(B, 4), lambda t, x: (x, torch.full_like(x, -math.inf)), 2
                        ),
                        ("-inf", "zero weight"),
                        True,
                    ),
                    (
                        "increments of the wrong shape",
                        lambda: SMC(4).filter(lambda B: torch.zeros(B, 4), lambda t, x: (x, torch.zeros(3)), 2),
                        ("step", "shape"),
                        False,
                    ),
                    (
                        "init of the wrong shape",
                        lambda: SMC(4).filter(lambda B: torch.zeros(B, 3), lambda t, x: (x, x), 2),
                        ("init", "shape"),
                        False,
                    ),
                    ("init not callable", lambda: SMC(4).filter(3, None, 2), ("init", "callable"), False),
                ]
            )
            cases.append(
                Case("inference.SMC", label, make, names=names, accepted="silent NaN" if non_finite else "silent wrong")
            )
    return cases


def gibbs_cases(rng, count: int, workdir: Path) -> list[Case]:
    """Few cases: NumPyro compiles for tens of seconds."""

    def sample(kwargs, tokens):
        from inference import Exact, Gibbs

        crf = random_crf(__import__("random").Random(3), 1.0, topology="window(1)")
        result = Gibbs(crf, **kwargs).sample(tokens)
        return {
            "z": torch.as_tensor(result.marginals.z),
            "exact": Exact(crf).marginals(tokens).z,
            "se": torch.as_tensor(result.standard_error.z),
        }

    def check(out):
        error = (out["z"].double() - out["exact"].double()).abs().max().item()
        return None if error < 0.1 else ("silent wrong", f"label marginals differ from Exact by {error:.3g}")

    valid = {"num_samples": 400, "num_warmup": 100, "num_chains": 2}
    cases = [
        Case(
            "inference.Gibbs",
            "label marginals vs Exact",
            lambda: sample(valid, torch.tensor([[1, 2, 3]])),
            expect="accept",
            check=check,
            timeout=240,
        ),
        Case(
            "inference.Gibbs",
            "num_samples=0",
            lambda: sample({**valid, "num_samples": 0}, torch.tensor([[1, 2]])),
            names=("num_samples",),
            timeout=120,
        ),
        Case(
            "inference.Gibbs",
            "num_chains=-1",
            lambda: sample({**valid, "num_chains": -1}, torch.tensor([[1, 2]])),
            names=("num_chains",),
            timeout=120,
        ),
        Case(
            "inference.Gibbs",
            "id = vocab_size",
            lambda: sample(valid, torch.tensor([[1, 6]])),
            names=("token", "vocab"),
            timeout=120,
        ),
        Case(
            "inference.Gibbs",
            "num_samples=10**12",
            lambda: sample({**valid, "num_samples": 10**12}, torch.tensor([[1, 2]])),
            names=("num_samples",),
            timeout=120,
        ),
    ]
    return cases[:count]
