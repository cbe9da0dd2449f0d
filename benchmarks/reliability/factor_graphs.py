"""graphs.topology (constructors, parse) against arc masks written from docs/api.md, and graphs.CRF."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import combined_expectation, mutations
from benchmarks.reliability.harness import Case


def topology_oracle(name: str, args: list, n: int) -> torch.Tensor:
    """The arc mask of one topology term, written from docs/api.md's table (not from
    graphs.topology): ``[n + m, n + m]``, True where dependent i may choose head j."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    off = i != j
    if name == "full":
        return off
    if name == "causal":
        return j < i
    if name == "window":
        return off & ((i - j).abs() <= args[0])
    if name == "segments":
        length, causal = args[0], (args[1] if len(args) > 1 else False)
        same, previous = i // length == j // length, j // length == i // length - 1
        return ((same & (j < i)) if causal else (same & off)) | previous
    if name == "star":
        wrap = args[0] if args else False
        ring = (i - j).abs() == 1
        if wrap and n > 2:
            ring = ring | ((i == 0) & (j == n - 1)) | ((i == n - 1) & (j == 0))
        full = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        full[:n, :n] = ring
        full[:n, n] = full[n, :n] = True
        return full
    if name == "root":
        full = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        full[:n, n] = True
        return full
    if name == "clusters":
        k = args[0]
        full = torch.zeros(n + k, n + k, dtype=torch.bool)
        for token in range(n):
            cluster = n + (token * k) // n
            full[token, cluster] = full[cluster, token] = True
        full[n:, n:] = ~torch.eye(k, dtype=torch.bool)
        return full
    raise KeyError(name)


def union_oracle(terms: list[tuple[str, list]], n: int) -> torch.Tensor:
    masks = [topology_oracle(name, args, n) for name, args in terms]
    extra = [m.shape[0] - n for m in masks]
    total = n + sum(extra)
    union = torch.zeros(total, total, dtype=torch.bool)
    offset = n
    for m, e in zip(masks, extra):
        index = torch.cat([torch.arange(n), torch.arange(offset, offset + e)])
        union[index[:, None], index[None, :]] |= m
        offset += e
    return union


def mask_check(terms, n: int):
    def check(found):
        expected = union_oracle(terms, n)
        if not isinstance(found, torch.Tensor) or found.dtype != torch.bool or found.shape != expected.shape:
            return "silent wrong", f"mask {getattr(found, 'shape', found)} is not a bool {tuple(expected.shape)}"
        if not torch.equal(found, expected):
            where = (found != expected).nonzero()[:3].tolist()
            return "silent wrong", f"mask differs from the documented arcs at {where}"
        return None

    return check


TERM_ARGS = {  # name -> a valid argument list generator
    "full": lambda rng: [],
    "causal": lambda rng: [],
    "window": lambda rng: [rng.randint(1, 4)],
    "star": lambda rng: rng.choice([[], [True], [False]]),
    "root": lambda rng: [],
    "clusters": lambda rng: [rng.randint(1, 4)],
    "segments": lambda rng: rng.choice([[rng.randint(1, 4)], [rng.randint(1, 4), rng.choice([True, False])]]),
}

BAD_ARGS = ["-1", "0", "2.5", "'x'", "10**12", "1000000000000", "", "(", "x=1", "True, True, True", "None"]


def topology_cases(rng, count: int, workdir: Path) -> list[Case]:
    from graphs import topology

    cases = []
    for _ in range(count):
        n = rng.randint(1, 7)
        terms = [(name, TERM_ARGS[name](rng)) for name in rng.sample(sorted(TERM_ARGS), rng.choice([1, 1, 2]))]
        if sum(name in ("star", "root", "clusters") for name, _ in terms) > 1:
            terms = terms[:1]
        if terms[0][0] == "clusters" and terms[0][1][0] > n:
            terms[0] = ("clusters", [n])
        text = " | ".join(f"{name}({', '.join(map(str, args))})" for name, args in terms)
        roll = rng.random()
        if roll < 0.3:  # the parsed text: the documented arcs
            cases.append(
                Case(
                    "graphs.topology.parse",
                    f"parse({text!r}).mask({n})",
                    lambda text=text, n=n: topology.parse(text).mask(n),
                    expect="accept",
                    check=mask_check(terms, n),
                )
            )
        elif roll < 0.5:  # the constructor itself
            name, args = terms[0]
            cases.append(
                Case(
                    "graphs.topology constructors",
                    f"{name}({args}).mask({n})",
                    lambda name=name, args=args, n=n: getattr(topology, name)(*args).mask(n),
                    expect="accept",
                    check=mask_check([terms[0]], n),
                )
            )
        elif roll < 0.75:  # a damaged text
            damage = rng.choice(["arg", "name", "separator", "paren", "junk"])
            if damage == "arg":
                name, argument = rng.choice(["window", "clusters", "segments", "star"]), rng.choice(BAD_ARGS)
                broken = f"{name}({argument})"
                if name in ("window", "segments") and argument in ("10**12", "1000000000000"):
                    broken = "either:" + broken  # a band or a segment longer than any sentence: valid
            elif damage == "name":
                broken = rng.choice(["fulll()", "win(2)", "cluster(2)", "stars()", "r00t()", "_()"])
            elif damage == "separator":
                broken = text + rng.choice([" |", " || full()", " & full()", "|", " , full()"])
            elif damage == "paren":
                broken = text.replace(")", "", 1) if ")" in text else text + ")"
            else:
                broken = rng.choice(["", " ", "|", "()", "\x00", "window(2) window(3)", "é()", "full() | " * 3])
            expect = "either" if broken.startswith("either:") else "refuse"
            broken = broken.removeprefix("either:")
            cases.append(
                Case(
                    "graphs.topology.parse",
                    f"parse({broken!r}).mask({n})",
                    lambda broken=broken, n=n: topology.parse(broken).mask(n),
                    expect=expect,
                    names=("topology", "segment") + tuple(TERM_ARGS) + ((broken,) if broken.strip() else ()),
                )
            )
        else:  # bad constructor arguments, bad sizes
            name, value = rng.choice(
                [
                    ("window", -1),
                    ("window", 0),
                    ("window", 2.5),
                    ("window", "2"),
                    ("window", None),
                    ("window", True),
                    ("clusters", 0),
                    ("clusters", -2),
                    ("clusters", 10**12),
                    ("clusters", "3"),
                    ("segments", 0),
                    ("segments", 10**12),
                    ("segments", 1.5),
                    ("star", "yes"),
                    ("mask", 0),
                    ("mask", -1),
                    ("mask", 2.5),
                    ("mask", 10**9),
                    ("mask", "4"),
                    ("mask", None),
                ]
            )
            base = rng.choice(["full", "causal", "root", "star"])
            if name == "mask":
                run = lambda value=value, base=base: getattr(topology, base)().mask(value)  # noqa: E731
                names, label = ("n", "length"), f"{base}().mask({value!r})"
            else:
                run = lambda name=name, value=value, n=n: getattr(topology, name)(value).mask(n)  # noqa: E731
                names, label = (name, "w", "k", "length", "wrap"), f"{name}({value!r}).mask({n})"
            expect = "either" if (name, value) == ("segments", 10**12) else "refuse"  # one segment: valid
            cases.append(Case("graphs.topology constructors", label, run, expect=expect, names=names))
    return cases


CRF_KEYS = {
    "vocab_size": ("int", 8),
    "labels": ("int", 2),
    "channels": ("int", 1),
    "rank": ("int", 2),
    "global_labels": ("int", 0),
    "topology": ("str", "full"),
    "gamma": ("int", 1),
    "ternary_form": ("str", "low_rank"),
    "ternary_blocks": ("int", 1),
    "global_memory": ("str", "dense"),
}


def build_crf(values: dict):
    from graphs import CRF

    crf = CRF(**values)
    crf.check_parameters()
    return dict(crf.named_parameters())


def crf_cases(rng, count: int, workdir: Path) -> list[Case]:
    cases = []
    for _ in range(count):
        values = {k: default for k, (_, default) in CRF_KEYS.items()}
        verdicts = {}
        for _ in range(rng.choice([0, 1, 1, 2])):
            name = rng.choice(sorted(CRF_KEYS))
            value, verdict = mutations(rng, name, CRF_KEYS[name][0], CRF_KEYS[name][1])
            if name in ("rank", "topology") and value is None:
                verdict = "either"  # documented: rank=None is labels, topology=None is "full"
            values[name], verdicts[name] = value, verdict
        expect = combined_expectation(verdicts)
        changed = list(verdicts)  # a refusal may name any of them: an "either" value can be out of range too
        non_finite = any(isinstance(values[k], float) and not math.isfinite(values[k]) for k in changed)
        cases.append(
            Case(
                "graphs.CRF",
                f"CRF { ({k: values[k] for k in changed}) }",
                lambda values=values: build_crf(values),
                expect=expect,
                names=tuple(changed) if set(verdicts.values()) == {"refuse"} else tuple(CRF_KEYS),
                accepted="silent NaN" if non_finite else "silent wrong",
            )
        )
    return cases
