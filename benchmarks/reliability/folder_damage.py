"""Random damage to a saved folder, a checkpoint or a torch export (shared by the
checkpoint and the load cases): truncated or bit-flipped weights, broken or mutated JSON,
a stored config value replaced, NaN, mis-shaped, mis-typed, extra or missing tensors,
pickle payloads, symlinks, a folder for a file, a bad vocabulary or tokenizer, a huge or
missing config."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import (
    HARMLESS_HUGE,
    payload_pickle,
)


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
