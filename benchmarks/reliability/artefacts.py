"""probformer.export, and probformer.load of damaged and crafted artefacts: torch folders, .pt2
archives (two known code-execution attacks among them, crafted by ``pt2_crafting``) and
ONNX files, and the loaded artefacts' own input checks."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from benchmarks.reliability.fixtures import KINDS, VOCAB, tiny_model, unrelated_file
from benchmarks.reliability.folder_damage import damage_folder
from benchmarks.reliability.harness import Case, nonfinite
from benchmarks.reliability.pt2_crafting import PT2_PAYLOADS, pt2_attack, write_pt2, zip_entries


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
