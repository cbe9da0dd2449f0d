"""probformer.export, and probformer.load of damaged and crafted artefacts: torch folders, .pt2
archives (two known code-execution attacks among them) and ONNX files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import KINDS, VOCAB, payload_pickle, tiny_model, unrelated_file
from benchmarks.reliability.folder_damage import damage_folder
from benchmarks.reliability.harness import Case, nonfinite


def export_cases(workdir: Path) -> list[Case]:
    """probformer.export; these run first: the artefacts they write are the templates that
    the crafted-file cases damage (a failed export leaves no template, and its crafted
    cases are left out rather than misread)."""
    import probformer

    templates = workdir / "templates"

    def export(kind, name, **kwargs):
        return lambda: probformer.export(tiny_model(kind), templates / name, **kwargs)

    cases = [
        Case(
            "probformer.export",
            "PT -> .pt2",
            export("probabilistic_transformer", "pt.pt2", format="exported"),
            expect="accept",
            timeout=240,
            finite=False,
        ),
        Case(
            "probformer.export",
            "PT -> .onnx",
            export("probabilistic_transformer", "pt.onnx", format="onnx"),
            expect="accept",
            timeout=240,
            finite=False,
        ),
    ]
    for kind in KINDS:  # docs/export.md: every kind exports to a torch folder
        cases.append(
            Case(
                "probformer.export",
                f"{kind} -> torch folder",
                export(kind, f"folder-{kind}"),
                expect="accept",
                timeout=120,
                finite=False,
            )
        )
    bad = [
        ("format='bogus'", export("transformer", "bad-format", format="bogus"), ("format",)),
        ("model=None", lambda: probformer.export(None, templates / "bad-none"), ("model",)),
        (
            "model is a graphs.CRF",
            lambda: probformer.export(__import__("graphs").CRF(5, 2), templates / "bad-crf"),
            ("model", "CRF"),
        ),
        ("tolerance=nan", export("transformer", "bad-tolerance", tolerance=math.nan), ("tolerance",)),
        ("tolerance=-1", export("transformer", "bad-tolerance2", tolerance=-1.0), ("tolerance",)),
        ("example of floats", export("transformer", "bad-example", example=torch.ones(2, 3)), ("example", "tokens")),
        (
            "example ids out of range",
            export("transformer", "bad-example2", example=torch.full((1, 3), 99)),
            ("example", "token", "vocab_size"),
        ),
        (
            "a checkpoint path that does not exist",
            lambda: probformer.export(workdir / "nowhere", templates / "bad-path"),
            ("nowhere",),
        ),
        (
            "path is an existing unrelated file (overwritten?)",
            lambda: probformer.export(tiny_model("transformer"), unrelated_file(workdir)),
            ("unrelated.txt", "exists", "path"),
        ),
    ]
    for label, run, names in bad:
        cases.append(
            Case(
                "probformer.export",
                label,
                run,
                names=names,
                timeout=60,
                accepted="silent NaN" if "nan" in label else "silent wrong",
            )
        )
    return cases


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


def code_execution_cases(workdir: Path) -> list[Case]:
    """Every pickle-payload .pt2 of ``pt2_attack``, once each (needs the .pt2 template)."""
    import probformer

    template = workdir / "templates" / "pt.pt2"
    if not template.is_file():
        return []
    cases = []
    for choice in PT2_PAYLOADS:
        marker = str(workdir / "markers" / f"attack-{choice.replace(' ', '-')}")
        label, entries, expect = pt2_attack(None, zip_entries(template), marker, choice)
        path = workdir / "loads" / f"attack-{choice.replace(' ', '-')}.pt2"

        def run(path=path, entries=entries):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_pt2(path, entries)
            return probformer.load(path)

        names = (str(path), path.name, "archive", "entry", "pickle", "layout")
        cases.append(
            Case(
                "probformer.load (.pt2)",
                f"attack: {label}",
                run,
                expect=expect,
                names=names,
                marker=marker,
                finite=False,
                timeout=60,
            )
        )
    return cases


def call_check(output):
    logits = output(torch.tensor([[4, 5, 6]]), torch.ones(1, 3, dtype=torch.bool))
    found = nonfinite(logits)
    return ("silent NaN", f"logits of a loaded artefact: {found}") if found else None


def load_cases(rng, count: int, workdir: Path) -> list[Case]:
    import probformer

    templates = workdir / "templates"
    folders = [templates / f"folder-{kind}" for kind in KINDS if (templates / f"folder-{kind}").is_dir()]
    files = [p for p in (templates / "pt.pt2", templates / "pt.onnx") if p.is_file()]
    cases = []
    for number in range(count):
        marker = str(workdir / "markers" / f"load-{number}")
        target = workdir / "loads" / f"case-{number}"
        roll = rng.random()
        if roll < 0.4 and folders:
            template = rng.choice(folders)
            if rng.random() < 0.1 and (template / "probformer_runtime.py").exists():
                label, expect, names = "probformer_runtime.py replaced by code that touches a marker", "either", ()
                apply = lambda c, m=marker: (c / "probformer_runtime.py").write_text(f"open({m!r}, 'w')\n")  # noqa: E731
            else:
                label, apply, expect, names = damage_folder(rng, template, "model.safetensors", marker, "export")

            def run(template=template, target=target, apply=apply):
                shutil.copytree(template, target, symlinks=True)
                apply(target)
                return probformer.load(target)

            entry, label = "probformer.load (torch folder)", f"{template.name}: {label}"
        elif roll < 0.75 and any(p.suffix == ".pt2" for p in files):
            template = templates / "pt.pt2"
            label, entries, expect = pt2_attack(rng, zip_entries(template), marker)
            cut = rng.randrange(template.stat().st_size)
            where, bit = rng.randrange(template.stat().st_size), 1 << rng.randrange(8)

            def run(template=template, target=target, label=label, entries=entries, cut=cut, where=where, bit=bit):
                target.parent.mkdir(parents=True, exist_ok=True)
                path = target.with_suffix(".pt2")
                if label == "truncate":
                    path.write_bytes(template.read_bytes()[:cut])
                elif label == "flip":
                    data = bytearray(template.read_bytes())
                    data[where] ^= bit
                    path.write_bytes(bytes(data))
                else:
                    write_pt2(path, entries)
                return probformer.load(path)

            label = {"truncate": f"truncated at {cut}", "flip": f"bit {bit} flipped at byte {where}"}.get(label, label)
            entry, names = "probformer.load (.pt2)", ()
        elif any(p.suffix == ".onnx" for p in files):
            template = templates / "pt.onnx"
            choice = rng.choice(["truncate", "flip", "metadata", "external"])
            size = template.stat().st_size
            cut, where, bit = rng.randrange(size), rng.randrange(size), 1 << rng.randrange(8)
            expect = "either" if choice == "flip" else "refuse"
            label = {
                "truncate": f"truncated at {cut}",
                "flip": f"bit {bit} flipped at byte {where}",
                "metadata": "probformer metadata removed",
                "external": "an initialiser's data in ../../outside.bin",
            }[choice]

            def run(template=template, target=target, choice=choice, cut=cut, where=where, bit=bit):
                target.parent.mkdir(parents=True, exist_ok=True)
                path = target.with_suffix(".onnx")
                data = template.read_bytes()
                if choice == "truncate":
                    path.write_bytes(data[:cut])
                elif choice == "flip":
                    flipped = bytearray(data)
                    flipped[where] ^= bit
                    path.write_bytes(bytes(flipped))
                else:
                    import onnx

                    proto = onnx.load_from_string(data)
                    if choice == "metadata":
                        del proto.metadata_props[:]
                    else:
                        tensor = max(proto.graph.initializer, key=lambda t: len(t.raw_data))
                        (target.parent.parent / "outside.bin").write_bytes(tensor.raw_data)
                        tensor.ClearField("raw_data")
                        tensor.data_location = onnx.TensorProto.EXTERNAL
                        entry = tensor.external_data.add()
                        entry.key, entry.value = "location", "../../outside.bin"
                    path.write_bytes(proto.SerializeToString())
                return probformer.load(path)

            entry, names = "probformer.load (.onnx)", ()
        else:
            continue
        path_names = (
            str(target),
            target.name,
            "model.safetensors",
            "config.json",
            "vocabulary",
            "archive",
            "entry",
            "pickle",
            "onnx",
            ".pt2",
            "layout",
        )
        cases.append(
            Case(
                entry,
                label,
                run,
                expect=expect,
                names=tuple(names) + path_names,
                check=call_check,
                marker=marker,
                finite=False,
                timeout=60,
                accepted="silent NaN" if "nan" in label.lower() or " inf" in label else "silent wrong",
            )
        )
    cases += code_execution_cases(workdir)
    # the loaded artefacts' own input checks
    artefacts = [(p, p.suffix or "folder") for p in folders[:1] + files]
    for path, what in artefacts:
        for label, tokens, mask, names in [
            ("float tokens", torch.ones(1, 3), None, ("tokens", "dtype", "integer")),
            ("1-D tokens", torch.tensor([1, 2]), None, ("tokens", "shape")),
            ("id = vocab_size", torch.tensor([[1, VOCAB]]), None, ("token", "vocab_size")),
            ("int mask", torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), ("mask",)),
            ("all-padding row", torch.tensor([[1, 2]]), torch.tensor([[False, False]]), ("row", "real token", "mask")),
        ]:
            run = lambda path=path, tokens=tokens, mask=mask: probformer.load(path)(tokens, mask)  # noqa: E731
            cases.append(Case(f"probformer.load (calling a {what.strip('.')})", label, run, names=names, timeout=60))
    return cases
