"""Pinned data sets, downloaded once into a cache folder with their SHA-256 checked.

``fetch("ud-ewt")`` puts the UD English-EWT r2.16 release files in
``data_home() / "ud-ewt"`` and returns that folder. ``data_home()`` is ``$PROBFORMER_DATA``,
else the user cache (``$XDG_CACHE_HOME/probformer``, ``~/.cache/probformer``; on Windows
``%LOCALAPPDATA%\\probformer``). ``$PROBFORMER_DATA_MIRROR`` (an ``http(s)://`` or
``file://`` URL of a folder laid out like the cache, ``NAME/FILE``) replaces the upstream
addresses, for machines without internet access; the checksums stay the same.

Each file is written to a temporary name in the target folder, hashed while it streams,
and renamed into place only when its hash is the pinned one: an interrupted or corrupted
download leaves nothing behind. A file already in place with the pinned hash is not
downloaded again."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PinnedFile", "PinnedDataset", "DATASETS", "data_home", "fetch", "fetch_dataset", "sha256_of"]

TIMEOUT_S = 60  # per network operation (connect, each read): a stalled server is an error, not a hang
CHUNK = 1 << 20


@dataclass(frozen=True)
class PinnedFile:
    name: str  # the file name in the data set's folder
    url: str
    sha256: str


@dataclass(frozen=True)
class PinnedDataset:
    name: str
    description: str
    licence: str
    files: tuple[PinnedFile, ...]


_EWT_COMMIT = "4c89b5833a70aa5ed3a00bad2f23f57992cc7df8"  # the tag r2.16 of UD_English-EWT (UD release 2.16)
_EWT_RAW = f"https://raw.githubusercontent.com/UniversalDependencies/UD_English-EWT/{_EWT_COMMIT}"

DATASETS: dict[str, PinnedDataset] = {
    "ud-ewt": PinnedDataset(
        name="ud-ewt",
        description="UD English-EWT r2.16 (Universal Dependencies 2.16, 2025-05-15): train, dev, test in CoNLL-U",
        licence="CC BY-SA 4.0",
        files=(
            PinnedFile(
                "en_ewt-ud-train.conllu",
                f"{_EWT_RAW}/en_ewt-ud-train.conllu",
                "3fb78e2b55482c8ee00caa653af436c88c9e5bc9a73ce26e4ae3ddc79d2b7e7b",
            ),
            PinnedFile(
                "en_ewt-ud-dev.conllu",
                f"{_EWT_RAW}/en_ewt-ud-dev.conllu",
                "531a54ff90d6ab12201c5a50c3e78e6ddac4de69abc4bce5d275d3cd29efe2b6",
            ),
            PinnedFile(
                "en_ewt-ud-test.conllu",
                f"{_EWT_RAW}/en_ewt-ud-test.conllu",
                "e266e515a0a7547657ed3d90d9ba46487d6bd251f27ad4269d4e8a427c8555cd",
            ),
            PinnedFile(
                "LICENSE.txt",
                f"{_EWT_RAW}/LICENSE.txt",
                "b3d1b0f4c6ae151f7eb78738f46ebd5ee140f8a7f76501ba26af123140d35ae7",
            ),
        ),
    ),
}


def data_home(cache: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``cache`` if given, else ``$PROBFORMER_DATA``, else the user cache."""
    if cache is not None and not isinstance(cache, str | os.PathLike):
        raise TypeError(f"cache must be a path or None, got {type(cache).__name__}")
    if cache is not None and str(cache):
        return Path(cache).expanduser()
    if os.environ.get("PROBFORMER_DATA"):
        return Path(os.environ["PROBFORMER_DATA"]).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "probformer"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "probformer"


def fetch(name: str, cache: str | os.PathLike | None = None) -> Path:
    """Download the pinned data set ``name`` (one of ``DATASETS``) into ``data_home(cache) /
    name`` unless it is there already, and return that folder."""
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; allowed: {sorted(DATASETS)}")
    return fetch_dataset(DATASETS[name], data_home(cache))


def fetch_dataset(dataset: PinnedDataset, home: Path) -> Path:
    """Download the files of ``dataset`` missing (or different) in ``home / dataset.name``."""
    folder = Path(home) / dataset.name
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    mirror = os.environ.get("PROBFORMER_DATA_MIRROR", "").rstrip("/")
    try:
        for pinned in dataset.files:
            target = folder / pinned.name
            if target.is_file() and sha256_of(target) == pinned.sha256:
                continue
            url = f"{mirror}/{dataset.name}/{pinned.name}" if mirror else pinned.url
            _download(url, target, pinned.sha256)
    except BaseException:
        if created and not any(folder.iterdir()):  # a failed first fetch leaves no empty folder either
            folder.rmdir()
        raise
    return folder


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, target: Path, sha256: str) -> None:
    """``url`` -> ``target`` through a temporary file in the same folder (so the rename is
    atomic), kept only if its SHA-256 is ``sha256``."""
    if not url.startswith(("https://", "http://", "file://")):
        raise ValueError(f"{target.name}: only https://, http:// and file:// URLs are fetched, got {url!r}")
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(handle, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 (schemes checked above)
                    while chunk := response.read(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except urllib.error.HTTPError as error:
                raise OSError(
                    f"could not download {target.name} from {url}: HTTP {error.code} {error.reason}"
                ) from None
            except (urllib.error.URLError, OSError) as error:
                reason = getattr(error, "reason", None) or error
                raise OSError(f"could not download {target.name} from {url}: {reason}") from None
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"{target.name} from {url} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                f"nothing was written to {target.parent}"
            )
        os.chmod(temporary, 0o644)  # mkstemp makes it private; a cache is shared like any download
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
