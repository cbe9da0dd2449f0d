"""Files a user hands to probformer: run configs (TOML) and checkpoint folders, damaged and crafted."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import (
    HARMLESS_HUGE,
    KINDS,
    VOCAB,
    forward,
    logits_of,
    payload_pickle,
    tiny_model,
    unrelated_file,
)
from benchmarks.reliability.harness import ROOT, Case, nonfinite


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value == math.inf else "-inf" if value == -math.inf else repr(value))
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):  # an inline table (a config's message weights): JSON's braces are not TOML
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def toml_text(tables: dict) -> str:
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [
            f"{key} = {value if isinstance(value, RawToml) else toml_value(value)}" for key, value in values.items()
        ]
        lines.append("")
    return "\n".join(lines)


class RawToml(str):
    """A TOML literal written as is (a wrong type, a bad token)."""


# (table, key) -> (values that must be refused, values that may be accepted)
RUN_KEYS = {
    ("model", "labels"): (["-1", "1000000000000", '"8"', "2.5", "true", "nan"], ["4", "16"]),
    ("model", "iterations"): (["0", "1000000000", '"3"'], ["1", "2"]),
    ("model", "width"): (["-1", "1000000000000", '"8"'], ["16"]),
    ("model", "dropout"): (["nan", "inf", "-0.5", "1.5", '"0.1"'], ["0.0", "0.3"]),
    ("model", "bogus_key"): (["1"], []),
    ("data", "max_length"): (["0", "-3", "1000000000000", '"90"', "nan"], ["8", "128"]),
    ("data", "vocabulary"): (["0", "2", '"x"', "1.5"], ["100", "1000000000000"]),
    ("data", "mask_rate"): (["nan", "inf", "0", "1", "-0.1", "true"], ["0.5"]),
    ("data", "task"): (['"bogus"', "3"], []),
    ("data", "source"): (["3", "true"], []),
    ("train", "lr"): (["inf", "nan", "0", "-1e-3", '"1e-3"', "-inf"], ["1e-4", "1.0"]),
    ("train", "batch_size"): (["0", "-1", "1000000000000", "2.5", '"32"'], ["1", "8"]),
    ("train", "weight_decay"): (["nan", "inf", "-1"], ["0.0"]),
    ("train", "clip"): (["nan", "inf", "-1"], ["0.0", "5.0"]),
    ("train", "schedule"): (['"bogus"', "1"], ['"cosine"']),
    ("train", "threads"): (["-1", "1000000000000", '"2"'], ["1"]),
    ("train", "seed"): (["-1", '"0"', "0.5"], ["1000000000000"]),
    ("train", "steps"): (["-1", '"10"'], ["5", "1000000000000"]),
    ("train", "bf16"): (['"yes"', "1"], ["true"]),
    ("train", "bogus_key"): (["1"], []),
    ("bogus_table", "x"): (["1"], []),
}

KIND_KEYS = {"labels": "probabilistic_transformer", "iterations": "probabilistic_transformer", "width": "transformer"}


def run_config_cases(rng, count: int, workdir: Path) -> list[Case]:
    import tomllib

    from probformer.training import run_config

    templates = sorted((ROOT / "configs").rglob("*.toml"))
    folder = workdir / "run-configs"
    folder.mkdir()
    cases = []
    for number in range(count):
        template = rng.choice(templates)
        text = template.read_text()
        path = folder / f"case-{number}.toml"
        roll = rng.random()
        if roll < 0.15:
            content, expect, names, label = text.encode(), "accept", (), f"{template.name} as is"
        elif roll < 0.6:
            tables = tomllib.loads(text)
            (table, key), (refuse, either) = rng.choice(sorted(RUN_KEYS.items()))
            wanted_kind = KIND_KEYS.get(key)
            if wanted_kind and tables.get("model", {}).get("kind") not in (
                wanted_kind,
                "particle_transformer" if key == "width" else wanted_kind,
            ):
                tables = tomllib.loads(
                    (ROOT / "configs" / ("pt-small.toml" if key != "width" else "bert-small.toml")).read_text()
                )
            use_refuse = not either or rng.random() < 0.7
            value = rng.choice(refuse if use_refuse else either)
            tables.setdefault(table, {})[key] = RawToml(value)
            content = toml_text(tables).encode()
            expect = "refuse" if use_refuse else "either"
            names = (key, table) if use_refuse else tuple(k for _, k in RUN_KEYS) + ("model", "data", "train")
            label = f"{template.name} with {table}.{key} = {value}"
        elif roll < 0.8:
            cut = rng.randrange(len(text))
            content, expect = text[:cut].encode(), "either"
            names = (path.name, "TOML", "kind", "model") + tuple(k for _, k in RUN_KEYS)
            label = f"{template.name} truncated at {cut}"
        elif roll < 0.92:
            where = rng.randrange(len(text))
            junk = rng.choice(["=", "[", "]]", '"', "\x00", "\\", "= =", "\n[model]\n", "\xff", "é"])
            content = (
                (text[:where] + junk + text[where:]).encode("utf-8", "surrogateescape")
                if junk != "\xff"
                else text[:where].encode() + b"\xff" + text[where:].encode()
            )
            expect = "either"
            names = (path.name, "TOML", "utf-8", "kind") + tuple(k for _, k in RUN_KEYS)
            label = f"{template.name} with {junk!r} inserted at {where}"
        else:
            special = rng.choice(["missing", "directory", "empty", "binary", "huge"])
            label, expect, names = f"path: {special}", "refuse", (path.name, str(path), "model", "kind")
            content = {"empty": b"", "binary": bytes(range(256)) * 4, "huge": b"#" * (64 << 20)}.get(special)
            if special == "directory":
                path.mkdir()
            if special == "huge":
                expect = "either"  # 64 MiB of comments is a valid, if odd, TOML file with no [model]

        def run(path=path, content=content):
            if content is not None and not path.exists():
                path.write_bytes(content)
            return run_config.load(path)

        cases.append(
            Case(
                "probformer.training.run_config.load",
                label,
                run,
                expect=expect,
                names=names,
                accepted="silent NaN"
                if any(x in label for x in ("nan", "inf")) and expect == "refuse"
                else "silent wrong",
            )
        )
    return cases


def make_checkpoint_templates(workdir: Path) -> dict[str, Path]:
    """One saved checkpoint per model kind (with a vocabulary), written by the parent."""
    from probformer.training import checkpoint
    from probformer.training.data import Vocabulary

    folders = {}
    for kind in KINDS:
        folder = workdir / "templates" / f"checkpoint-{kind}"
        vocabulary = Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(VOCAB - 3)])
        checkpoint.save(tiny_model(kind), folder, vocabulary=vocabulary)
        folders[kind] = folder
    return folders


def stored_value_mutation(rng, key: str, stored) -> tuple[object, str]:
    """(value, expect) replacing a stored config value: wrong types and non-finite or absurd
    values must be refused; a negative or huge float may be in range."""
    wrong = [None, "x", [], {}, math.nan, math.inf]
    if isinstance(stored, bool):
        refuse, either = wrong + [-1, 2.5, 10**12], [not stored]
    elif isinstance(stored, int):
        refuse, either = wrong + [-1, 2.5, True] + ([] if key in HARMLESS_HUGE else [10**12]), [0, 1, 3]
        either += [10**12] if key in HARMLESS_HUGE else []
    elif isinstance(stored, float):
        refuse, either = wrong + [True], [-1.0, 0.0, 0.5, 2.5, 1e12]
    elif isinstance(stored, str):
        refuse, either = [None, "x", -1, 2.5, 10**12, True, math.nan, []], []
        either = [{}] if key == "weights" else []
    else:  # a dict (PT weights, export scales)
        refuse, either = [None, "x", -1, math.nan, []], [{}]
    if not either or rng.random() < 0.7:
        return rng.choice(refuse), "refuse"
    return rng.choice(either), "either"


def damage_folder(
    rng, folder: Path, weights: str, marker: str, loader: str = "checkpoint"
) -> tuple[str, Callable[[Path], None], str, tuple]:
    """A random damage to a saved folder (checkpoint or torch export): (label, apply(copy),
    expect, extra names). ``weights`` is the name of the safetensors file; ``loader``
    ("checkpoint" or "export") says whether an auxiliary file (tokenizer.json) must be read."""
    import json as json_module

    config = json_module.loads((folder / "config.json").read_text())
    inner = config.get("config", {})
    size = (folder / weights).stat().st_size
    header = int.from_bytes((folder / weights).read_bytes()[:8], "little") + 8
    choice = rng.choice(
        [
            "truncate",
            "flip header",
            "flip data",
            "json",
            "config key",
            "nan weight",
            "shape",
            "dtype",
            "extra key",
            "missing key",
            "pickle weights",
            "pickle config",
            "symlink fifo",
            "symlink zero",
            "symlink copy",
            "directory",
            "vocabulary",
            "tokenizer",
            "huge config",
            "no config",
        ]
    )
    names: tuple = (weights, "config.json")
    expect = "refuse"

    def rewrite_weights(copy: Path, change) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(copy / weights))
        change(tensors)
        save_file(tensors, str(copy / weights))

    if choice == "truncate":
        cut = rng.randrange(size)
        label, apply = f"{weights} truncated at {cut} of {size}", lambda c: os.truncate(c / weights, cut)
    elif choice in ("flip header", "flip data"):
        where = rng.randrange(8, header) if choice == "flip header" else rng.randrange(header, size)
        bit = 1 << rng.randrange(8)

        def apply(c, where=where, bit=bit):
            data = bytearray((c / weights).read_bytes())
            data[where] ^= bit
            (c / weights).write_bytes(bytes(data))

        label, expect = f"{weights} bit {bit} flipped at byte {where} ({choice})", "either"
    elif choice == "json":
        text = (folder / "config.json").read_text()
        mutated = rng.choice(
            [
                text[: rng.randrange(len(text))],
                "[]",
                "null",
                '"x"',
                "{}",
                text.replace('"format"', '"formt"'),
                text.replace(config.get("model", "x"), "bogus_model"),
                text + "}",
                "NaN",
            ]
        )
        label = f"config.json replaced ({mutated[:40]!r}...)"
        apply = lambda c, m=mutated: (c / "config.json").write_text(m)  # noqa: E731
    elif choice == "config key":
        key = rng.choice(sorted(inner))
        value, expect = stored_value_mutation(rng, key, inner[key])
        changed = dict(config, config=dict(inner, **{key: value}))
        text = json_module.dumps(changed)  # json writes NaN / Infinity literals, as a careless writer would
        names = (key,)
        label = f"config key {key} = {value!r}"
        apply = lambda c, t=text: (c / "config.json").write_text(t)  # noqa: E731
    elif choice == "nan weight":
        value = rng.choice([math.nan, math.inf, -math.inf])

        def apply(c, value=value):
            rewrite_weights(c, lambda t: next(iter(t.values())).view(-1).__setitem__(0, value))

        label, names = f"a weight set to {value}", ("nan", "inf", "finite", weights)
    elif choice == "shape":
        label, names = "a tensor with one more row", ("shape", weights)

        def apply(c):
            rewrite_weights(c, lambda t: t.update({k: torch.cat([v, v[:1]]) for k, v in list(t.items())[:1]}))

    elif choice == "dtype":
        label, expect = "weights stored as float64", "either"
        apply = lambda c: rewrite_weights(c, lambda t: t.update({k: v.double() for k, v in t.items()}))  # noqa: E731
    elif choice == "extra key":
        label, names = "an unexpected tensor", ("unexpected", "extra", weights)
        apply = lambda c: rewrite_weights(c, lambda t: t.update({"evil.weight": torch.zeros(2)}))  # noqa: E731
    elif choice == "missing key":
        label, names = "a tensor missing", ("missing", weights)
        apply = lambda c: rewrite_weights(c, lambda t: t.pop(sorted(t)[0]))  # noqa: E731
    elif choice == "pickle weights":
        label = f"{weights} replaced by a pickle payload"
        apply = lambda c: (c / weights).write_bytes(payload_pickle(marker))  # noqa: E731
    elif choice == "pickle config":
        label = "config.json replaced by a pickle payload"
        apply = lambda c: (c / "config.json").write_bytes(payload_pickle(marker))  # noqa: E731
    elif choice == "symlink fifo":
        label = f"{weights} a symlink to a FIFO (reading would block)"

        def apply(c):
            os.mkfifo(c / "fifo")
            (c / weights).unlink()
            (c / weights).symlink_to(c / "fifo")
    elif choice == "symlink zero":
        label = "config.json a symlink to /dev/zero"

        def apply(c):
            (c / "config.json").unlink()
            (c / "config.json").symlink_to("/dev/zero")
    elif choice == "symlink copy":
        label, expect = f"{weights} a symlink to a valid copy outside the folder", "either"

        def apply(c):
            outside = c.parent / f"{c.name}-outside.safetensors"
            shutil.copy(c / weights, outside)
            (c / weights).unlink()
            (c / weights).symlink_to(outside)
    elif choice == "directory":
        label = f"{weights} is a directory"

        def apply(c):
            (c / weights).unlink()
            (c / weights).mkdir()
    elif choice == "vocabulary":
        mutated = rng.choice(["[1, 2, 3]", "{}", "not json", '["<pad>", "<unk>", "<mask>"]', "null", '["a"] '])
        label, names = f"vocabulary.json = {mutated!r}", ("vocabulary",)
        apply = lambda c, m=mutated: (c / "vocabulary.json").write_text(m)  # noqa: E731
    elif choice == "tokenizer":
        mutated = rng.choice(
            ["{}", "not json", '{"model": {"type": "BPE", "vocab": 3}}', "[]", payload_pickle(marker).hex()]
        )
        label, names = f"tokenizer.json = {mutated[:40]!r}", ("tokenizer",)
        expect = "refuse" if loader == "checkpoint" else "either"  # an export's loader may ignore it
        apply = lambda c, m=mutated: (c / "tokenizer.json").write_text(m)  # noqa: E731
    elif choice == "huge config":
        label = "config.json a 256 MiB sparse file"

        def apply(c):
            with open(c / "config.json", "r+b") as file:
                file.truncate(256 << 20)
    else:
        label, names = "config.json missing", ("config.json",)
        apply = lambda c: (c / "config.json").unlink()  # noqa: E731
    return label, apply, expect, names


def loaded_check(output):
    """An accepted damaged file must at least give finite parameters and logits."""
    model = output[0] if isinstance(output, tuple) else output
    for name, tensor in getattr(model, "state_dict", dict)().items():
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            return "silent NaN", f"loaded a non-finite parameter {name}"
    logits = logits_of(forward(model, torch.tensor([[4, 5, 6]]), torch.ones(1, 3, dtype=torch.bool)))
    found = nonfinite(logits)
    return ("silent NaN", f"logits of a loaded model: {found}") if found else None


def checkpoint_cases(rng, count: int, workdir: Path) -> list[Case]:
    from probformer.training import checkpoint

    templates = make_checkpoint_templates(workdir)
    cases = []
    for number in range(count):
        kind = rng.choice(sorted(templates))
        copy = workdir / "checkpoints" / f"case-{number}"
        marker = str(workdir / "markers" / f"checkpoint-{number}")
        label, apply, expect, names = damage_folder(rng, templates[kind], "model.safetensors", marker)

        def run(kind=kind, copy=copy, apply=apply):
            shutil.copytree(templates[kind], copy, symlinks=True)
            apply(copy)
            return checkpoint.load(copy)

        cases.append(
            Case(
                "probformer.training.checkpoint.load",
                f"{kind}: {label}",
                run,
                expect=expect,
                names=names + (str(copy),),
                check=loaded_check,
                marker=marker,
                finite=False,
                accepted="silent NaN" if "nan" in label.lower() or "inf" in label else "silent wrong",
            )
        )
    for special, run in [
        ("a path that does not exist", lambda: checkpoint.load(workdir / "nowhere")),
        ("a file, not a folder", lambda: checkpoint.load(unrelated_file(workdir))),
        ("an empty folder", lambda: checkpoint.load(Path(tempfile.mkdtemp(dir=workdir)))),
    ]:
        cases.append(
            Case(
                "probformer.training.checkpoint.load",
                special,
                run,
                names=("nowhere", "unrelated.txt", "config.json", "checkpoint", str(workdir)),
            )
        )
    return cases


class LeftBehind(Exception):
    """A failed write left a temporary or half-written file behind."""


def save_cases(rng, count: int, workdir: Path) -> list[Case]:
    """checkpoint.save on a full disk: RLIMIT_FSIZE stops every write beyond a few bytes
    (each write then fails with EFBIG, as on a full disk); the save must end in one clear
    error naming the path and leave nothing half-written, or succeed completely."""
    import resource

    from probformer.training import checkpoint
    from probformer.training.data import Vocabulary

    vocabulary = Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(VOCAB - 3)])
    cases = []
    for number in range(count):
        kind = rng.choice(sorted(KINDS))
        limit = rng.choice([0, 1, 100, 1000, 5000, 20000, 10**6])
        existing = rng.random() < 0.3  # saving over a previous checkpoint must keep it whole
        folder = workdir / "saves" / f"case-{number}"

        def run(kind=kind, limit=limit, folder=folder, existing=existing):
            if existing:
                checkpoint.save(tiny_model(kind, seed=1), folder, vocabulary=vocabulary)
            before = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            try:
                return checkpoint.save(tiny_model(kind), folder, vocabulary=vocabulary)
            except BaseException as error:
                after = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
                if after != before:
                    raise LeftBehind(f"{type(error).__name__}: {error}; files before {before}, after {after}") from None
                raise
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

        def check(path, kind=kind):
            model, _ = checkpoint.load(path)
            expected = tiny_model(kind).state_dict()
            for name, tensor in model.state_dict().items():
                if not torch.equal(tensor, expected[name]):
                    return "silent wrong", f"the saved {name} differs from the model's"
            return None

        label = f"{kind}, writes limited to {limit} bytes{', over an older checkpoint' if existing else ''}"
        cases.append(
            Case(
                "probformer.training.checkpoint.save",
                label,
                run,
                expect="either",
                names=(str(folder), folder.name, "model.safetensors", "config.json", "vocabulary.json"),
                check=check,
                finite=False,
            )
        )
    return cases
