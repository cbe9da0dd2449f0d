"""Non-finite values (NaN, +inf, -inf) at every public entry point where a float enters:
token embeddings (engines on an embeddings CRF), hidden states (PTLayer), CRF and model
parameters, SMC increments, the diagnostics' weights and states, and the inputs of models
and exported models (float token ids). Each must be refused by a clear error naming the
argument (or the parameter); a NaN that only sits at a padded position must change nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import KINDS, VOCAB, fresh_model
from benchmarks.reliability.harness import Case

BAD = (math.nan, math.inf, -math.inf)
ENGINES = ("Exact", "MeanField", "Gibbs")


def _label(value: float) -> str:
    return {True: "NaN"}.get(math.isnan(value), "+inf" if value > 0 else "-inf")


def _batch(rng, max_batch=2, max_length=3, padding=True):
    """``(lengths, n, mask)``: right-padded rows of random real lengths."""
    lengths = [rng.randint(1, max_length) for _ in range(rng.randint(1, max_batch))]
    n = max(lengths) + (rng.randint(0, 2) if padding else 0)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return lengths, n, mask


def _poison(tensor: torch.Tensor, rng, value: float, where: torch.Tensor | None = None) -> str:
    """Write ``value`` at one random entry (one where ``where``, a bool mask of the leading
    dims, is true); returns the index as text."""
    candidates = (where if where is not None else torch.ones(tensor.shape[:1], dtype=torch.bool)).nonzero()
    lead = candidates[rng.randrange(len(candidates))].tolist()
    rest = [rng.randrange(size) for size in tensor.shape[len(lead) :]]
    with torch.no_grad():
        tensor[tuple(lead + rest)] = value
    return str(lead + rest)


def _crf(seed: int, embedding: bool):
    from graphs import CRF

    torch.manual_seed(seed)
    source = dict(embedding_size=3) if embedding else dict(vocab_size=6)
    return CRF(labels=2, channels=1, rank=2, global_labels=2, **source)


def _engine(name: str, crf):
    import inference

    if name == "Gibbs":  # refusals come before JAX compiles anything: these cases stay fast
        return inference.Gibbs(crf, num_samples=20, num_warmup=5, num_chains=1)
    return {"Exact": inference.Exact, "MeanField": inference.MeanField}[name](crf)


def embedding_case(rng) -> Case:
    engine, value, seed = rng.choice(ENGINES), rng.choice(BAD), rng.randrange(2**31)
    lengths, n, mask = _batch(rng)
    padded_only = engine != "Gibbs" and not mask.all() and rng.random() < 0.25

    def run():
        x = torch.randn(len(lengths), n, 3, generator=torch.Generator().manual_seed(seed))
        _poison(x, rng_copy, value, where=~mask if padded_only else mask)
        return _engine(engine, _crf(seed, True))(embeddings=x, mask=mask)

    rng_copy = __import__("random").Random(seed)
    where = "a padded position (must change nothing)" if padded_only else "a real token"
    return Case(
        f"non-finite: inference.{engine} (embeddings)",
        f"{_label(value)} at {where}, lengths {lengths}, n={n}",
        run,
        expect="accept" if padded_only else "refuse",
        names=("embeddings",),
        accepted="silent NaN",
    )


def crf_parameter_case(rng) -> Case:
    engine = rng.choice(ENGINES + ("CRF.log_potential",))
    value, seed = rng.choice(BAD), rng.randrange(2**31)
    name = rng.choice(["unary", "ternary_u", "ternary_v", "binary"])
    lengths, n, mask = _batch(rng)

    def run():
        crf = _crf(seed, False)
        _poison(getattr(crf, name), __import__("random").Random(seed), value)
        tokens = torch.randint(0, 6, (len(lengths), n), generator=torch.Generator().manual_seed(seed))
        if engine == "CRF.log_potential":
            N = crf.topology.num_nodes(n)
            z, h = torch.zeros(len(lengths), N, dtype=torch.long), torch.zeros(len(lengths), 1, N, dtype=torch.long)
            return crf.log_potential(tokens, z, h, torch.zeros(len(lengths), n, dtype=torch.long), mask)
        return _engine(engine, crf)(tokens, mask)

    entry = engine if engine.startswith("CRF") else f"inference.{engine}"
    return Case(
        f"non-finite: {entry} (CRF parameters)", f"{_label(value)} in {name}", run, names=(name,), accepted="silent NaN"
    )


def pt_layer_case(rng) -> Case:
    value, seed = rng.choice(BAD), rng.randrange(2**31)
    lengths, n, mask = _batch(rng)
    in_weights = rng.random() < 0.3
    parameter = rng.choice(["crf.unary", "crf.ternary_u", "output.weight", "output.bias"])

    def run():
        from probformer.models.pt_layer import PTLayer

        torch.manual_seed(seed)
        layer = PTLayer(4, labels=3, channels=1, rank=2)
        hidden = torch.randn(len(lengths), n, 4, generator=torch.Generator().manual_seed(seed))
        poison_rng = __import__("random").Random(seed)
        if in_weights:
            _poison(layer.get_parameter(parameter), poison_rng, value)
        else:
            _poison(hidden, poison_rng, value, where=mask)
        with torch.no_grad():
            return layer(hidden, mask)

    label = f"{_label(value)} in {parameter}" if in_weights else f"{_label(value)} in hidden at a real token"
    names = (parameter, parameter.split(".")[-1]) if in_weights else ("hidden",)
    return Case("non-finite: PTLayer", label, run, names=names, accepted="silent NaN")


def model_case(rng) -> Case:
    kind, value, seed = rng.choice(sorted(KINDS)), rng.choice(BAD), rng.randrange(2**31)
    lengths, n, mask = _batch(rng, max_length=5)
    float_tokens = rng.random() < 0.3
    model = fresh_model(kind)
    names = [name for name, p in model.named_parameters() if p.is_floating_point()]
    parameter = rng.choice(names)

    def run():
        net = fresh_model(kind)
        tokens = torch.randint(0, VOCAB, (len(lengths), n), generator=torch.Generator().manual_seed(seed))
        if float_tokens:
            tokens = tokens.double().masked_fill(~mask, value)
            tokens[0, 0] = value
        else:
            _poison(net.get_parameter(parameter), __import__("random").Random(seed), value)
        with torch.no_grad():
            return net(tokens, mask)

    label = f"float tokens with {_label(value)}" if float_tokens else f"{_label(value)} in {parameter}"
    found = ("tokens",) if float_tokens else (parameter, parameter.split(".")[-1])
    return Case(f"non-finite: {kind}.forward", label, run, names=found, accepted="silent NaN")


def smc_case(rng) -> Case:
    value, seed = rng.choice(BAD), rng.randrange(2**31)
    B, N, T = rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 4)
    step_bad, row, particle = rng.randrange(T), rng.randrange(B), rng.randrange(N)
    every_particle = value == -math.inf and rng.random() < 0.5  # all zero weight: refused
    threshold = rng.choice([0.0, 0.5, 1.0])

    def run():
        from inference import SMC

        generator = torch.Generator().manual_seed(seed)

        def step(t, x):
            increment = torch.randn(B, N, generator=generator)
            if t == step_bad:
                increment[row, :] = value if every_particle else increment[row, :]
                increment[row, particle] = value
            return x + 1.0, increment

        return SMC(N, ess_threshold=threshold, generator=generator).filter(
            lambda b: torch.zeros(b, N, 1), step, T, batch_size=B
        )

    one_zero = value == -math.inf and not every_particle and N > 1
    label = f"increment {_label(value)} at step {step_bad}" + (" on every particle" if every_particle else "")

    def check(result):  # a weight of zero is legal: the evidence stays finite
        return None if bool(torch.isfinite(result.log_evidence).all()) else ("silent NaN", "log_evidence not finite")

    if one_zero:
        return Case("non-finite: inference.SMC (increments)", label, run, expect="accept", check=check, finite=False)
    return Case(
        "non-finite: inference.SMC (increments)",
        label,
        run,
        names=("increment", "log-weights", "zero weight"),
        accepted="silent NaN",
    )


def diagnostics_case(rng) -> Case:
    from probformer import diagnostics

    function = rng.choice(["ess(weights)", "ess(log_weights)", "pareto_k", "diversity"])
    value, seed = rng.choice(BAD), rng.randrange(2**31)
    if function in ("ess(log_weights)", "pareto_k") and value == -math.inf:
        value = rng.choice([math.nan, math.inf])  # -inf is a legal log-weight (a weight of zero)
    size = rng.randint(1, 40)

    def run():
        x = torch.randn(2, size, generator=torch.Generator().manual_seed(seed))
        if function == "diversity":
            hidden = torch.randn(2, size, 3, generator=torch.Generator().manual_seed(seed))
            _poison(hidden, __import__("random").Random(seed), value)
            return diagnostics.diversity(hidden)
        _poison(x, __import__("random").Random(seed), value)
        if function == "ess(weights)":
            return diagnostics.ess(x.abs())
        if function == "ess(log_weights)":
            return diagnostics.ess(log_weights=x)
        return diagnostics.pareto_k(x).k

    name = {"ess(weights)": "weights", "diversity": "hidden"}.get(function, "log_weights")
    entry = f"non-finite: probformer.diagnostics.{function.split('(')[0]}"
    return Case(entry, f"{function} with {_label(value)}, {size} values", run, names=(name,), accepted="silent NaN")


def exported_cases(rng, workdir: Path, count: int) -> list[Case]:
    """Float token ids holding NaN / inf, called on each loaded export (torch folder, .pt2, .onnx)."""
    import probformer

    templates = workdir / "templates"
    paths = [templates / f"folder-{kind}" for kind in KINDS if (templates / f"folder-{kind}").is_dir()][:1]
    paths += [p for p in (templates / "pt.pt2", templates / "pt.onnx") if p.is_file()]
    cases = []
    for number in range(count if paths else 0):
        path, value = paths[number % len(paths)], rng.choice(BAD)
        lengths, n, mask = _batch(rng)
        tokens = torch.ones(len(lengths), n, dtype=rng.choice([torch.float32, torch.float64])).masked_fill(~mask, value)
        tokens[0, 0] = value

        def run(path=path, tokens=tokens, mask=mask):
            return probformer.load(path)(tokens, mask)

        what = path.suffix.strip(".") or "folder"
        label = f"{tokens.dtype} tokens with {_label(value)}"
        cases.append(
            Case(
                f"non-finite: probformer.load (calling a {what})", label, run, names=("tokens",), accepted="silent NaN"
            )
        )
    return cases


MAKERS = (  # (maker, share of the cases)
    (embedding_case, 0.25),
    (crf_parameter_case, 0.15),
    (pt_layer_case, 0.1),
    (model_case, 0.25),
    (smc_case, 0.1),
    (diagnostics_case, 0.12),
)


def non_finite_cases(rng, count: int, workdir: Path) -> list[Case]:
    """``count`` cases: each maker its share, the exported models the rest (>= 1 each)."""
    cases = []
    for maker, share in MAKERS:
        cases += [maker(rng) for _ in range(max(1, round(count * share)))]
    return cases + exported_cases(rng, workdir, max(3, count - len(cases)))
