"""Every code block of README.md and docs/*.md runs as written.

- Each file's ``python`` blocks run in order as one script (a notebook), in a fresh
  interpreter started in an empty folder (so what they write stays out of the
  repository) that sees the repository's ``configs/`` and ``examples/``.
- A block is marked by an HTML comment on the line just before its fence:
  ``<!-- docs-test: skip REASON -->`` leaves it out (the reason is the test's skip
  message: a GPU, the network, a long run); ``<!-- docs-test: fragment of "NAME" -->``
  says it continues the setup block that a ``<!-- docs-test: setup "NAME" -->`` marks
  (the setup runs first in the file's script, and a fragment is only run there).
- Every command line that calls the CLI (``probformer ...``, ``python -m probformer``)
  in any block, transcripts included, is parsed by the CLI's own parser: its verb and
  options exist and take those values. The quick transcripts (``<!-- docs-test: run -->``)
  are run, and each command's first output line must be the one shown.
- No page cites a repository file that does not exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from probformer import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*docs-test:\s*(skip|fragment of|setup|run)\s*(.*?)\s*-->\s*$")
# pages whose script takes more than a few seconds: run with -m slow (the reason is the skip message)
HEAVY = {
    "export.md": "traces the model for torch.export and ONNX (~1 min on 2 cores)",
    "factors.md": "samples with NumPyro's Gibbs and trains a tagger for a few steps",
}


class Block:
    def __init__(self, page: Path, line: int, language: str, text: str, mark: tuple[str, str] | None):
        self.page, self.line, self.language, self.text, self.mark = page, line, language, text, mark

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next(j for j in range(index + 1, len(lines)) if lines[j].startswith("```"))
        previous = MARK.match(lines[index - 1]) if index else None
        mark = (previous.group(1), previous.group(2).strip('"')) if previous else None
        found.append(Block(page, index + 1, opening.group(1), "\n".join(lines[index + 1 : end]), mark))
        index = end + 1
    return found


def script_of(page: Path) -> tuple[str, list[str]]:
    """The page's python blocks as one script, in the page's order (a fragment after the
    setup it continues), and the skipped blocks with their reasons."""
    python = [b for b in blocks(page) if b.language == "python"]
    skipped = [f"{b.where}: {b.mark[1]}" for b in python if b.mark and b.mark[0] == "skip"]
    parts = []
    for block in python:
        if block.mark and block.mark[0] == "skip":
            continue
        if block.mark and block.mark[0] == "fragment of":
            setups = [b for b in python if b.mark == ("setup", block.mark[1])]
            assert setups and setups[0].line < block.line, f"{block.where}: no setup {block.mark[1]!r} before it"
        parts.append(f"# ---- {block.where}\n{block.text}\n")
    return "\n".join(parts), skipped


def python_pages() -> list:
    params = []
    for page in PAGES:
        if any(b.language == "python" for b in blocks(page)):
            heavy = HEAVY.get(page.name)
            params.append(pytest.param(page, id=page.name, marks=[pytest.mark.slow] if heavy else []))
    return params


def workspace(tmp_path: Path) -> dict:
    """An empty folder seeing the repository's configs and examples; the interpreter's
    environment: the repository importable, one thread, no display."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "JAX_PLATFORMS": "cpu",
    }


@pytest.mark.parametrize("page", python_pages())
def test_the_python_blocks_of_each_page_run_in_order(page, tmp_path):
    script, skipped = script_of(page)
    (tmp_path / "page.py").write_text(script)
    result = subprocess.run(
        [sys.executable, "page.py"], cwd=tmp_path, env=workspace(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stderr[-3000:]}"
    for reason in skipped:
        print(f"skipped {reason}")


def test_heavy_and_skipped_blocks_say_why():
    for page in PAGES:
        for block in blocks(page):
            if block.mark and block.mark[0] == "skip":
                assert len(block.mark[1]) > 8, f"{block.where}: a skipped block says why"


# ---- the command line -----------------------------------------------------------------------

PROGRAMS = (".venv/bin/probformer", "probformer")


def cli_commands(block: Block) -> list[list[str]]:
    """The CLI calls in a block: lines (or ``$ ``-prompted lines of a transcript) starting
    with ``probformer``, ``.venv/bin/probformer`` or ``[.venv/bin/]python -m probformer``;
    comments dropped; ``[...]`` optional parts and ``<...>`` placeholders left out."""
    commands = []
    lines = block.text.split("\n")
    if any(line.startswith("$ ") for line in lines):  # a transcript: the prompted lines are the commands,
        # and the commands it prints for the reader to run next (the demo's)
        lines = [line for line in lines if line.startswith("$ ") or line.strip().startswith(".venv/bin/probformer ")]
    for line in lines:
        line = line.removeprefix("$ ").strip()
        line = re.sub(r"\s+#.*$", "", line)
        words = line.split(maxsplit=1)
        if not words:
            continue
        if words[0] in PROGRAMS:
            rest = words[1] if len(words) > 1 else ""
        elif re.match(r"^(\.venv/bin/)?python -m probformer(\.mup)? ", line) or line.startswith("torchrun "):
            module = re.search(r"-m probformer(\.mup)? (.*)$", line)
            if not module:
                continue
            rest = ("mup " if module.group(1) else "") + module.group(2)
        else:
            continue
        if "..." in rest or "<" in rest or "|" in rest:
            continue  # a synopsis, not a command
        rest = re.sub(r"\[[^\]]*\]", "", rest)
        commands.append(shlex.split(rest))
    return commands


def all_commands() -> list:
    params = []
    for page in PAGES:
        for block in blocks(page):
            if block.mark and block.mark[0] == "run":
                continue  # run and compared with its output (errors included) below
            for number, argv in enumerate(cli_commands(block)):
                params.append(pytest.param(argv, id=f"{block.where}-{number}"))
    return params


@pytest.mark.parametrize("argv", all_commands())
def test_every_documented_command_parses(argv):
    parser = cli.build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exit:
        if argv[:1] != ["--version"]:
            raise AssertionError(f"the CLI refuses the documented command: probformer {shlex.join(argv)}") from exit


def transcripts() -> list:
    params = []
    for page in PAGES:
        for block in blocks(page):
            if block.mark and block.mark[0] == "run":
                params.append(pytest.param(block, id=block.where))
    return params


@pytest.mark.parametrize("block", transcripts())
def test_quick_transcripts_print_what_they_show(block, tmp_path):
    environment = workspace(tmp_path)
    lines = block.text.split("\n")
    for index, line in enumerate(lines):
        if not line.startswith("$ "):
            continue
        shown = lines[index + 1] if index + 1 < len(lines) and not lines[index + 1].startswith("$ ") else ""
        command = line[2:].replace(".venv/bin/probformer", f"{sys.executable} -m probformer", 1)
        command = re.sub(r"^probformer\b", f"{sys.executable} -m probformer", command)
        result = subprocess.run(command, shell=True, cwd=tmp_path, env=environment, capture_output=True, text=True)
        printed = (result.stdout + result.stderr).split("\n")[0]
        assert printed == shown, f"{block.where}: {line}\nprinted {printed!r}\nshown   {shown!r}"


# ---- citations ------------------------------------------------------------------------------

FOLDERS = "docs|probformer|graphs|inference|tests|benchmarks|configs|examples"
CITED = re.compile(rf"(?<![\w/.-])((?:{FOLDERS})/[\w./*-]*[\w*])")
LOCAL_MD = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
# files a documented command writes, named before it has run
WRITTEN = {
    "docs/benchmarks/gpu.json": "make gpu-check writes it on a GPU machine",
    "report.md": "probformer diagnose writes it beside the figures",
}


def test_no_page_cites_a_file_the_repository_lacks():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in set(CITED.findall(text)) - set(WRITTEN):
            found = list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if not found:
                missing.append(f"{page.name}: {path}")
        for name in set(LOCAL_MD.findall(text)) - set(WRITTEN):
            if not ((ROOT / "docs" / name).exists() or (ROOT / name).exists()):
                missing.append(f"{page.name}: {name}")
    assert sorted(missing) == []
