"""Crafted ``.pt2`` archives: a template's entries, an archive written the way
torch.export.save writes it (duplicate names and names torch refuses included), and one
crafted archive per attack: issue 17's two code-execution attacks (a duplicate entry whose
first copy is a pickle payload, an opaque-object constant) and other pickle payloads, path
traversal, a bad probformer record, dropped or duplicated entries."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.reliability.fixtures import payload_pickle


def zip_entries(path: Path) -> list[tuple[str, bytes]]:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def write_pt2(path: Path, entries: list[tuple[str, bytes]]) -> None:
    """Write a crafted .pt2 the way torch.export.save does (aligned entries, torch's own zip
    writer), so that a loader's deeper checks are reached, not only its layout check;
    duplicate names (which torch's writer cannot write) go through ``zipfile``."""
    names = [name for name, _ in entries]
    if len(set(names)) < len(names):
        return write_duplicates(path, entries)
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    root = names[0].split("/")[0] + "/"
    written_by_torch = (".data/version", ".data/serialization_id", "byteorder")
    try:
        with PT2ArchiveWriter(str(path)) as writer:  # the archive's root folder is the file's stem
            for name, data in entries:
                if name.removeprefix(root) not in written_by_torch:
                    writer.write_bytes(name.removeprefix(root), data)
    except Exception:  # a name torch's writer refuses (e.g. "../"): zipfile writes anything
        path.unlink(missing_ok=True)
        write_zip(path, entries)


def write_duplicates(path: Path, entries: list[tuple[str, bytes]]) -> None:
    """Two entries of one name in an archive otherwise exactly as torch writes it: each
    earlier copy is written under a placeholder name of the same length, then the
    placeholder's bytes (local header and central directory) are renamed."""
    seen, renamed, placeholders = set(), [], {}
    for index, (name, data) in enumerate(entries):
        if name in seen or any(n == name for n, _ in entries[index + 1 :]):
            if name not in seen and name not in placeholders:
                placeholder = name[:-3] + "~~~"
                placeholders[placeholder] = name
                renamed.append((placeholder, data))
                seen.add(name)
                continue
        seen.add(name)
        renamed.append((name, data))
    write_pt2(path, renamed)
    content = path.read_bytes()
    for placeholder, name in placeholders.items():
        root = content[30 : content.index(b"/", 30)].decode() + "/"  # the first entry's folder
        old, new = (root + placeholder.split("/", 1)[1]).encode(), (root + name.split("/", 1)[1]).encode()
        content = content.replace(old, new)
    path.write_bytes(content)


def write_zip(path: Path, entries: list[tuple[str, bytes]]) -> None:
    import warnings
    import zipfile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point of some cases
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            for name, data in entries:
                archive.writestr(name, data)


PT2_PAYLOADS = ("dup sample", "dup weights", "opaque", "custom", "use_pickle", "pkl", "sample pickle")


def pt2_attack(rng, entries: list[tuple[str, bytes]], marker: str, choice: str | None = None):
    """(label, entries, expect) of one crafted .pt2. "dup sample" and "opaque" rebuild issue
    17's two code-execution attacks: (a) two entries of one name, a pickle payload first
    (``zipfile`` reads the last copy, torch the first); (b) an ``opaque_obj_*`` constant,
    which torch.export.load unpickles with ``pickle.loads``."""
    names = [name for name, _ in entries]
    find = lambda suffix: next(n for n in names if n.endswith(suffix))  # noqa: E731
    data = dict(entries)
    evil = payload_pickle(marker)
    choice = choice or rng.choice(PT2_PAYLOADS + ("traversal", "meta", "truncate", "flip", "drop", "duplicate benign"))
    if choice == "dup sample":  # (a) zipfile reads the last copy, torch the first
        sample = find("sample_inputs/model.pt")
        return "duplicate sample_inputs entry, the first a pickle payload", [(sample, evil)] + entries, "refuse"
    if choice == "dup weights":
        config_name = find("weights/model_weights_config.json")
        config = json.loads(data[config_name])
        first = sorted(config["config"])[0]
        config["config"][first]["use_pickle"] = True
        weight = config_name.rsplit("/", 1)[0] + "/" + config["config"][first]["path_name"]
        crafted = [(config_name, json.dumps(config).encode()), (weight, evil)]
        return (
            "duplicate weights config and weight, the first copies marking a pickle payload",
            crafted + entries,
            "refuse",
        )
    if choice in ("opaque", "custom"):  # (b) an opaque object constant is pickle.loads-ed
        config_name = find("constants/model_constants_config.json")
        weights_config = json.loads(data[find("weights/model_weights_config.json")])
        meta = next(iter(weights_config["config"].values()))["tensor_meta"]
        prefix = "opaque_obj_" if choice == "opaque" else "custom_obj_"
        config = {
            "config": {"evil": {"path_name": f"{prefix}0", "is_param": False, "use_pickle": False, "tensor_meta": meta}}
        }
        folder = config_name.rsplit("/", 1)[0]
        crafted = [(n, json.dumps(config).encode() if n == config_name else d) for n, d in entries]
        return f"a {prefix}0 constant holding a pickle payload", crafted + [(f"{folder}/{prefix}0", evil)], "refuse"
    if choice == "use_pickle":
        config_name = find("weights/model_weights_config.json")
        config = json.loads(data[config_name])
        first = sorted(config["config"])[0]
        config["config"][first]["use_pickle"] = True
        weight = config_name.rsplit("/", 1)[0] + "/" + config["config"][first]["path_name"]
        crafted = [
            (n, json.dumps(config).encode() if n == config_name else evil if n == weight else d) for n, d in entries
        ]
        return "a weight marked use_pickle, holding a pickle payload", crafted, "refuse"
    if choice == "pkl":
        return (
            "an extra .pkl entry holding a pickle payload",
            entries + [(names[0].split("/")[0] + "/data/evil.pkl", evil)],
            "refuse",
        )
    if choice == "sample pickle":
        sample = find("sample_inputs/model.pt")
        return (  # a loader may refuse it or ignore it (re-packing fresh sample inputs); never run it
            "sample_inputs replaced by a pickle payload",
            [(n, evil if n == sample else d) for n, d in entries],
            "either",
        )
    if choice == "traversal":
        return "an entry named ../../evil.json", entries + [("../../evil.json", b"{}")], "refuse"
    if choice == "meta":
        meta_name = find("extra/probformer.json")
        meta = json.loads(data[meta_name])
        key, value = rng.choice(
            [("model", "bogus"), ("format", "x"), ("config", [])]
            + [(("config", k), v) for k in ("vocab_size",) for v in (10**12, -1, "x", None)]
        )
        if isinstance(key, tuple):
            meta["config"][key[1]] = value
        else:
            meta[key] = value
        crafted = [(n, json.dumps(meta).encode() if n == meta_name else d) for n, d in entries]
        return f"probformer.json {key} = {value!r}", crafted, "refuse"
    if choice == "drop":
        dropped = rng.choice(names)
        return f"entry {dropped} removed", [(n, d) for n, d in entries if n != dropped], "either"
    if choice == "duplicate benign":
        name = rng.choice(names)
        return f"entry {name} stored twice (same bytes)", entries + [(name, data[name])], "either"
    return choice, entries, "either"  # truncate / flip: applied to the bytes by the caller
