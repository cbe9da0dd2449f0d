"""Run configs (TOML) a user hands to ``probformer.training.run_config.load``: the shipped
configs as they are, with one key set to a value that must be refused or may be accepted,
truncated, with junk inserted, and paths that are missing, a folder, empty, binary or
huge."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.reliability.harness import ROOT, Case


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
