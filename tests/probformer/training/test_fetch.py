"""Pinned data sets: download with checksum, atomic placement, no second download, clear
errors. Files come from a loopback HTTP server or file:// URLs: no test needs the network."""

import hashlib
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from probformer.training import fetch

SERVER_LIFETIME_S = 60  # a loopback server stops by itself after this, whatever the test does


class LoopbackServer:
    """Serves a folder on 127.0.0.1 (a free port) from a daemon thread and counts requests."""

    def __init__(self, folder: Path):
        requests = self.requests = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def do_GET(self):  # noqa: N802 (the http.server API)
                requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):  # keep the test output clean
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.timer = threading.Timer(SERVER_LIFETIME_S, self.server.shutdown)
        self.timer.daemon = True

    def __enter__(self):
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


FILES = {"a.conllu": b"1\ta\t_\tNOUN\t_\t_\t0\troot\t_\t_\n", "b.txt": "second file \u00e9\n".encode() * 1000}


def toy_dataset(base_url: str, checksums: dict[str, str] | None = None) -> fetch.PinnedDataset:
    checksums = checksums or {name: sha256(content) for name, content in FILES.items()}
    files = tuple(fetch.PinnedFile(name, f"{base_url}/toy/{name}", checksums[name]) for name in FILES)
    return fetch.PinnedDataset("toy", "two small files", "CC0", files)


@pytest.fixture
def served(tmp_path):
    """A folder laid out like a mirror (``toy/FILE``), served on loopback."""
    root = tmp_path / "served"
    (root / "toy").mkdir(parents=True)
    for name, content in FILES.items():
        (root / "toy" / name).write_bytes(content)
    with LoopbackServer(root) as server:
        yield root, server


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_download_checks_and_places_the_files_then_is_a_no_op(tmp_path, served):
    _, server = served
    home = tmp_path / "cache"
    folder = fetch.fetch_dataset(toy_dataset(server.url), home)
    assert folder == home / "toy"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == FILES  # no temporary file left
    assert sorted(server.requests) == ["/toy/a.conllu", "/toy/b.txt"]
    fetch.fetch_dataset(toy_dataset(server.url), home)
    assert len(server.requests) == 2  # the second fetch downloads nothing
    (folder / "b.txt").write_bytes(b"edited by hand")
    fetch.fetch_dataset(toy_dataset(server.url), home)
    assert server.requests[2:] == ["/toy/b.txt"] and (folder / "b.txt").read_bytes() == FILES["b.txt"]


def test_a_bad_checksum_names_the_file_and_both_hashes_and_leaves_nothing(tmp_path, served):
    _, server = served
    wrong = "0" * 64
    checksums = {name: sha256(content) for name, content in FILES.items()} | {"b.txt": wrong}
    home = tmp_path / "cache"
    with pytest.raises(ValueError) as caught:
        fetch.fetch_dataset(toy_dataset(server.url, checksums), home)
    message = str(caught.value)
    assert "b.txt" in message and sha256(FILES["b.txt"]) in message and wrong in message
    assert leftovers(home / "toy") == ["a.conllu"]  # the good file stays; no part of b.txt
    checksums["a.conllu"] = wrong
    with pytest.raises(ValueError, match="a.conllu"):
        fetch.fetch_dataset(toy_dataset(server.url, checksums), tmp_path / "fresh")
    assert leftovers(tmp_path / "fresh") == []  # not even the data set's folder


def test_a_missing_file_or_a_dead_server_is_a_clear_error(tmp_path, served):
    root, server = served
    (root / "toy" / "b.txt").unlink()
    with pytest.raises(OSError, match=r"could not download b.txt from http://127.0.0.1:\d+/toy/b.txt: HTTP 404"):
        fetch.fetch_dataset(toy_dataset(server.url), tmp_path / "cache")
    assert leftovers(tmp_path / "cache" / "toy") == ["a.conllu"]
    dead = LoopbackServer(root)  # bound, then closed without serving: nothing listens on its port
    dead.server.server_close()
    with pytest.raises(OSError, match=r"could not download a.conllu from http://127.0.0.1:\d+/toy/a.conllu: "):
        fetch.fetch_dataset(toy_dataset(dead.url), tmp_path / "dead")
    assert leftovers(tmp_path / "dead") == []
    with pytest.raises(ValueError, match="only https://, http:// and file:// URLs"):
        fetch.fetch_dataset(toy_dataset("ftp://example.org"), tmp_path / "other")


def test_file_urls_and_the_mirror_variable(tmp_path, served, monkeypatch):
    root, _ = served
    folder = fetch.fetch_dataset(toy_dataset(root.as_uri()), tmp_path / "by-file-url")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == FILES
    # the mirror replaces the upstream address (here one that cannot resolve), keeping the checksums
    monkeypatch.setenv("PROBFORMER_DATA_MIRROR", root.as_uri() + "/")
    folder = fetch.fetch_dataset(toy_dataset("https://upstream.invalid"), tmp_path / "by-mirror")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == FILES


def test_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PROBFORMER_DATA", raising=False)
    assert fetch.data_home() == tmp_path / "xdg" / "probformer"
    monkeypatch.setenv("PROBFORMER_DATA", str(tmp_path / "env"))
    assert fetch.data_home() == tmp_path / "env"
    assert fetch.data_home(tmp_path / "arg") == tmp_path / "arg"
    with pytest.raises(TypeError, match="cache must be a path"):
        fetch.data_home(3)


def test_the_registry_pins_the_ewt_release():
    with pytest.raises(ValueError, match=re.escape("unknown data set 'ud-ewtt'; allowed: ['ud-ewt']")):
        fetch.fetch("ud-ewtt")
    ewt = fetch.DATASETS["ud-ewt"]
    names = {"en_ewt-ud-train.conllu", "en_ewt-ud-dev.conllu", "en_ewt-ud-test.conllu", "LICENSE.txt"}
    assert {f.name for f in ewt.files} == names and ewt.licence == "CC BY-SA 4.0"
    for pinned in ewt.files:  # one release commit (the tag r2.16), a full SHA-256 for each file
        assert re.fullmatch(
            r"https://raw\.githubusercontent\.com/UniversalDependencies/UD_English-EWT/"
            r"4c89b5833a70aa5ed3a00bad2f23f57992cc7df8/" + re.escape(pinned.name),
            pinned.url,
        )
        assert re.fullmatch(r"[0-9a-f]{64}", pinned.sha256)


# ---- `probformer data fetch` as a user runs it ----


def probformer(*args, env):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "probformer", *args], env=environment, capture_output=True, text=True, timeout=120
    )


def test_the_data_fetch_command(tmp_path):
    """The real registry entry against a loopback mirror serving wrong bytes: exit status 2,
    one line naming the file and both hashes, nothing in the cache; then an unknown name."""
    mirror = tmp_path / "mirror" / "ud-ewt"
    mirror.mkdir(parents=True)
    for pinned in fetch.DATASETS["ud-ewt"].files:
        (mirror / pinned.name).write_text("not the treebank\n")
    cache = tmp_path / "cache"
    with LoopbackServer(mirror.parent) as server:
        result = probformer(
            "data", "fetch", "ud-ewt", "--cache", str(cache), env={"PROBFORMER_DATA_MIRROR": server.url}
        )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    expected = fetch.DATASETS["ud-ewt"].files[0]
    assert len(lines) == 1 and lines[0].startswith("probformer data fetch: error: ")
    assert expected.name in lines[0] and expected.sha256 in lines[0] and sha256(b"not the treebank\n") in lines[0]
    assert leftovers(cache) == []
    result = probformer("data", "fetch", "wikitext", env={"PROBFORMER_DATA": str(cache)})
    assert result.returncode == 2 and "allowed: ['ud-ewt']" in result.stderr and len(result.stderr.splitlines()) == 1
