"""Tools to craft damaged and malicious archives: a payload whose unpickling creates a
marker file (proof that code from the file ran), a ``.pt2``'s entries, an archive rewritten
with torch's own zip writer (so only the content is crafted) or written byte by byte (so
anything torch's writer never writes can be), and the entry whose name ends in a suffix."""

import io
import struct
import zipfile
import zlib
from pathlib import Path

import torch


class Payload:
    """Unpickling this creates the marker file: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def entries_of(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as source:
        return {info.filename: source.read(info) for info in source.infolist()}


def write_torch_archive(path: Path, entries: dict[str, bytes]) -> Path:
    """An archive in torch's own zip layout (its writer), so only the content is crafted."""
    from torch.export.pt2_archive import PT2ArchiveWriter

    with PT2ArchiveWriter(str(path)) as writer:
        for name, data in entries.items():
            name = name.split("/", 1)[1]
            if name not in (".data/version", ".data/serialization_id", "byteorder"):  # the writer adds these
                writer.write_bytes(name, data)
    return path


def write_plain_zip(path: Path, items: list, external_attr: int = 0, tail: bytes = b"", gap: bytes = b"") -> Path:
    """A stored zip written byte by byte: no extra fields, no attributes unless asked (what
    the strict reader accepts), but anything torch's writer never writes: duplicate names,
    odd names, symlink attributes, bytes after the end."""
    local, central = bytearray(), bytearray()
    for name, data in items:
        raw, crc = name.encode(), zlib.crc32(data)
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0)
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                0,
                0,
                0,
                crc,
                len(data),
                len(data),
                len(raw),
                0,
                0,
                0,
                0,
                external_attr,
                len(local),
            )
            + raw
        )
        local += header + raw + data + gap  # gap: bytes no entry owns
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(items), len(items), len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end) + tail)
    return path


def key(entries, suffix):
    return next(name for name in entries if name.endswith(suffix))
