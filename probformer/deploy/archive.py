"""Strict reading of the zip archives probformer loads (the .pt2 of ``torch.export.save``).

A zip can be read two ways: from its central directory (Python's ``zipfile``, torch's
reader) or from its local headers, and two readers can pick different entries of the
same name. ``read_zip`` therefore accepts only archives where that question cannot
arise: every byte of the file belongs to exactly one entry, the central directory and
the local headers agree entry by entry, names are unique, relative and plain, entries
are stored (not compressed) and their CRC-32 is right. ``read_pt2`` then checks that the entries are the layout
``torch.export.save`` writes for a probformer model, and the loader re-packs the checked
entries into a fresh archive: torch never reads a byte of the original file.
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
import zlib
from dataclasses import dataclass, field

from probformer.deploy.program_check import check_program
from probformer.deploy.program_check import read_json as _json

__all__ = ["read_zip", "check_entry_name", "read_pt2", "repack_pt2", "Pt2Archive", "Payload"]

MAX_ENTRIES = 100_000
_LOCAL, _CENTRAL, _DESCRIPTOR = 0x04034B50, 0x02014B50, 0x08074B50
_END, _END64, _LOCATOR64 = 0x06054B50, 0x06064B50, 0x07064B50
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_END_RECORD = struct.Struct("<IHHHHIIH")  # 22 bytes
_END64_RECORD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR64_RECORD = struct.Struct("<IIQI")  # 20 bytes
_PADDING_FIELD = 0x4246  # "FB": the alignment padding torch's writer puts in local headers
_ALLOWED_FLAGS = 0x0808  # bit 3: sizes in a data descriptor; bit 11: UTF-8 names
_NAME_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")


def check_entry_name(name: str, where) -> None:
    """Refuse names that are absolute, climb (``..``), use backslashes or odd characters."""
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or any(part in ("", ".", "..") or not _NAME_PART.match(part) for part in parts)
    ):
        raise ValueError(f"{where}: archive entry name {name!r} is not a plain relative path; refusing the archive")


def _unpack(record: struct.Struct, data: bytes, offset: int, where, what: str) -> tuple:
    if offset < 0 or offset + record.size > len(data):
        raise ValueError(f"{where}: truncated zip archive ({what} at byte {offset} runs past the end)")
    return record.unpack_from(data, offset)


def _directory_bounds(data: bytes, where) -> tuple[int, int, int]:
    """``(entries, start, end)`` of the central directory, from the end records; the
    directory must end exactly where the end records begin."""
    end_at = len(data) - _END_RECORD.size
    sig, disk, disk_cd, count_disk, count, size, start, comment = _unpack(
        _END_RECORD, data, end_at, where, "end record"
    )
    if sig != _END or comment != 0:
        raise ValueError(f"{where}: not a zip archive written by torch (no end record, or a trailing comment)")
    if disk or disk_cd or count_disk != count:
        raise ValueError(f"{where}: multi-disk zip archives are refused")
    directory_end = end_at
    locator_at = end_at - _LOCATOR64_RECORD.size
    if locator_at >= 0 and struct.unpack_from("<I", data, locator_at)[0] == _LOCATOR64:
        _, disk, end64_at, disks = _unpack(_LOCATOR64_RECORD, data, locator_at, where, "zip64 locator")
        if disk != 0 or disks != 1 or end64_at != locator_at - _END64_RECORD.size:
            raise ValueError(f"{where}: zip64 locator does not point right before itself")
        sig, record_size, _, _, disk, disk_cd, count_disk, count, size, start = _unpack(
            _END64_RECORD, data, end64_at, where, "zip64 end record"
        )
        if sig != _END64 or record_size != _END64_RECORD.size - 12 or disk or disk_cd or count_disk != count:
            raise ValueError(f"{where}: malformed zip64 end record")
        directory_end = end64_at
    if start + size != directory_end:
        raise ValueError(f"{where}: bytes between the central directory and the end record; refusing the archive")
    if count > MAX_ENTRIES:
        raise ValueError(f"{where}: {count} entries in the archive; at most {MAX_ENTRIES} are accepted")
    return count, start, directory_end


def _local_data(data: bytes, offset: int, name: str, central: tuple, where) -> tuple[bytes, int]:
    """The data of the entry whose local header is at ``offset``, checked against its
    central record ``(flags, crc, size)``; returns ``(data, offset just past the entry)``."""
    flags, crc, size = central
    sig, _, local_flags, method, _, _, local_crc, csize, usize, name_len, extra_len = _unpack(
        _LOCAL_HEADER, data, offset, where, f"local header of {name!r}"
    )
    if sig != _LOCAL or local_flags != flags or method != 0:
        raise ValueError(f"{where}: local header of {name!r} disagrees with the central directory")
    at = offset + _LOCAL_HEADER.size
    if data[at : at + name_len] != name.encode():
        raise ValueError(f"{where}: entry named {name!r} in the central directory has another local name")
    at += name_len
    extra_end = at + extra_len
    while at < extra_end:  # only torch's alignment padding may sit in a local header
        field, length = _unpack(struct.Struct("<HH"), data, at, where, "extra field")
        if field != _PADDING_FIELD or at + 4 + length > extra_end:
            raise ValueError(f"{where}: unexpected extra field {field:#06x} in the local header of {name!r}")
        at += 4 + length
    allowed = {(crc, size, size), (0, 0, 0)} if flags & 0x8 else {(crc, size, size)}
    if (local_crc, csize, usize) not in allowed:
        raise ValueError(f"{where}: local sizes or CRC of {name!r} disagree with the central directory")
    content = data[at : at + size]
    if len(content) != size:
        raise ValueError(f"{where}: truncated zip archive (entry {name!r} runs past the end)")
    at += size
    if flags & 0x8:  # the data descriptor, with its signature, as torch writes it
        descriptor = _unpack(struct.Struct("<IIII"), data, at, where, f"data descriptor of {name!r}")
        if descriptor != (_DESCRIPTOR, crc, size, size):
            raise ValueError(f"{where}: data descriptor of {name!r} disagrees with the central directory")
        at += 16
    if zlib.crc32(content) != crc:
        raise ValueError(f"{where}: CRC-32 mismatch in entry {name!r}: the archive is damaged")
    return content, at


def read_zip(data: bytes, where) -> dict[str, bytes]:
    """The entries of a zip archive in ``data`` as ``{name: bytes}``, in file order.

    ``ValueError`` naming ``where`` unless: entries are stored uncompressed, unencrypted,
    with no external attributes (so no symlinks) and no comments; names are unique plain
    relative paths; each local header sits exactly where the previous entry ended (the
    first at byte 0) and agrees with its central record; the central directory follows
    the last entry directly and the end records follow it; every CRC-32 is right.
    """
    count, directory, directory_end = _directory_bounds(data, where)
    entries: dict[str, bytes] = {}
    at, expected_local = directory, 0
    for _ in range(count):
        fields = _unpack(_CENTRAL_HEADER, data, at, where, "central directory record")
        sig, _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len, comment_len = fields[:13]
        disk, internal, external, local_offset = fields[13:]
        raw_name = data[at + _CENTRAL_HEADER.size : at + _CENTRAL_HEADER.size + name_len]
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}: archive entry name {raw_name!r} is not UTF-8") from None
        if sig != _CENTRAL or method != 0 or csize != usize or flags & ~_ALLOWED_FLAGS:
            raise ValueError(f"{where}: entry {name!r} is compressed, encrypted or malformed; refusing the archive")
        if extra_len or comment_len or disk or internal or external:
            raise ValueError(f"{where}: entry {name!r} has extra fields, a comment or file attributes (a symlink?)")
        check_entry_name(name, where)
        if name in entries:
            raise ValueError(f"{where}: duplicate archive entry {name!r}; refusing the archive")
        if local_offset != expected_local:
            raise ValueError(f"{where}: entry {name!r} is not where the previous one ended (hidden bytes?)")
        entries[name], expected_local = _local_data(data, local_offset, name, (flags, crc, usize), where)
        at += _CENTRAL_HEADER.size + name_len
    if at != directory_end or expected_local != directory:
        raise ValueError(f"{where}: bytes outside the archive's entries; refusing the archive")
    return entries


# ---- the .pt2 layout torch.export.save writes for a probformer model -------------------

MODEL = "model"  # torch.export.save names its one program "model"
_FIXED = {"archive_format": b"pt2", "archive_version": b"0", "byteorder": b"little"}
_OPTIONAL = ("data/sample_inputs/model.pt", ".data/serialization_id")  # read by no one, or replaced
_PROGRAM, _EXTRA = "models/model.json", "extra/probformer.json"
_WEIGHTS_CONFIG, _CONSTANTS_CONFIG = (
    "data/weights/model_weights_config.json",
    "data/constants/model_constants_config.json",
)
_PAYLOAD = {"data/weights/": re.compile(r"^weight_\d{1,6}$"), "data/constants/": re.compile(r"^tensor_\d{1,6}$")}
# serialized dtype codes of torch._export.serde.schema.ScalarType (a stable schema)
DTYPES = {4: "int32", 5: "int64", 6: "float16", 7: "float32", 8: "float64", 12: "bool", 13: "bfloat16"}
_ENTRY_KEYS = {"path_name", "is_param", "use_pickle", "tensor_meta"}
_META_KEYS = {"dtype", "sizes", "requires_grad", "device", "strides", "storage_offset", "layout"}
_STRIDED = 7
MAX_ELEMENTS = 1 << 31


@dataclass
class Payload:
    """One weight or constant as stored: its config entry, its raw bytes, and the dtype
    name and shape the entry declares (checked against the byte count)."""

    entry: dict
    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Pt2Archive:
    """The checked content of a probformer .pt2: ``meta`` (probformer.json), ``program``
    (the graph JSON, with free-form metadata and guard code removed), ``weights`` and
    ``constants`` (``{fqn: Payload}``) and the JSON config of each."""

    meta: dict
    program: dict
    weights: dict[str, Payload]
    constants: dict[str, Payload]
    weights_config: dict = field(default_factory=dict)
    constants_config: dict = field(default_factory=dict)


def _strip_root(entries: dict[str, bytes], where) -> dict[str, bytes]:
    """torch puts every entry under one root folder (named after the file); drop it."""
    roots = {name.split("/", 1)[0] for name in entries}
    if len(roots) != 1 or any("/" not in name for name in entries):
        raise ValueError(f"{where}: archive entries are not under one root folder (found {sorted(roots)[:5]})")
    return {name.split("/", 1)[1]: data for name, data in entries.items()}


def _check_layout(entries: dict[str, bytes], where) -> None:
    for name, value in _FIXED.items():
        if entries.get(name) != value:
            raise ValueError(f"{where}: not a torch.export archive ({name!r} is not {value!r})")
    required = {*_FIXED, ".data/version", _PROGRAM, _EXTRA, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG}
    missing = sorted(required - set(entries))
    if missing:
        raise ValueError(f"{where}: not a probformer .pt2 export: missing entries {missing}")
    for name in entries:
        folder, _, base = name.rpartition("/")
        payload = _PAYLOAD.get(folder + "/")
        if name not in required and name not in _OPTIONAL and not (payload and payload.match(base)):
            raise ValueError(
                f"{where}: unexpected archive entry {name!r}; a probformer .pt2 holds only the program, raw "
                "tensors, their configs and probformer.json (no pickles, custom objects or compiled code)"
            )
    if not re.fullmatch(rb"\d{1,3}\n?", entries[".data/version"]):
        raise ValueError(f"{where}: malformed .data/version entry")


def _as_int(value, what: str, where) -> int:
    if not (isinstance(value, dict) and set(value) == {"as_int"} and type(value["as_int"]) is int):
        raise ValueError(f"{where}: {what} must be a plain integer, got {value!r}")
    return value["as_int"]


def _payloads(config, folder: str, entries: dict[str, bytes], where) -> dict[str, Payload]:
    """``{fqn: Payload}`` of a weights or constants config: every entry a raw, contiguous
    CPU tensor (no ``use_pickle``, no custom or opaque object) whose bytes match its size."""
    if not (isinstance(config, dict) and set(config) == {"config"} and isinstance(config["config"], dict)):
        raise ValueError(f"{where}: malformed {folder} config")
    payloads = {}
    for fqn, entry in config["config"].items():
        if not (isinstance(entry, dict) and set(entry) == _ENTRY_KEYS and isinstance(entry["tensor_meta"], dict)):
            raise ValueError(f"{where}: {folder} entry {fqn!r} is not a raw tensor record; refusing the archive")
        if entry["use_pickle"] is not False or type(entry["is_param"]) is not bool:
            raise ValueError(f"{where}: {folder} entry {fqn!r} asks for unpickling; refusing the archive")
        path_name, meta = entry["path_name"], entry["tensor_meta"]
        if not (isinstance(path_name, str) and _PAYLOAD[folder].match(path_name)) or folder + path_name not in entries:
            raise ValueError(f"{where}: {folder} entry {fqn!r} points to {path_name!r}, not a raw tensor entry")
        if set(meta) != _META_KEYS or meta["device"] != {"type": "cpu", "index": None} or meta["layout"] != _STRIDED:
            raise ValueError(f"{where}: {folder} entry {fqn!r} is not a strided CPU tensor")
        if type(meta["dtype"]) is not int or meta["dtype"] not in DTYPES or type(meta["requires_grad"]) is not bool:
            raise ValueError(f"{where}: {folder} entry {fqn!r} has dtype code {meta['dtype']!r}; allowed: {DTYPES}")
        if not (isinstance(meta["sizes"], list) and isinstance(meta["strides"], list)):
            raise ValueError(f"{where}: {folder} entry {fqn!r} has no list of sizes and strides")
        shape = tuple(_as_int(size, f"a size of {fqn!r}", where) for size in meta["sizes"])
        strides = [_as_int(stride, f"a stride of {fqn!r}", where) for stride in meta["strides"]]
        if any(size < 0 for size in shape) or math.prod(shape) > MAX_ELEMENTS:
            raise ValueError(f"{where}: {folder} entry {fqn!r} has shape {shape}; at most {MAX_ELEMENTS} elements")
        contiguous = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        if strides != contiguous or _as_int(meta["storage_offset"], "a storage offset", where) != 0:
            raise ValueError(f"{where}: {folder} entry {fqn!r} is not a contiguous tensor")
        dtype = DTYPES[meta["dtype"]]
        data = entries[folder + path_name]
        if len(data) != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(f"{where}: {folder}{path_name} holds {len(data)} bytes, not a {dtype} tensor of {shape}")
        payloads[fqn] = Payload(entry, data, dtype, shape)
    return payloads


_ITEMSIZE = {"int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8, "bool": 1, "bfloat16": 2}


def read_pt2(data: bytes, where) -> Pt2Archive:
    """Check that ``data`` is a .pt2 archive in exactly the layout ``torch.export.save``
    writes for a probformer model (see ``_check_layout``) and return its checked content.
    Nothing is unpickled; the sample inputs are not read (the loader writes its own)."""
    entries = _strip_root(read_zip(data, where), where)
    _check_layout(entries, where)
    meta = _json(entries[_EXTRA], _EXTRA, where)
    weights_config = _json(entries[_WEIGHTS_CONFIG], _WEIGHTS_CONFIG, where)
    constants_config = _json(entries[_CONSTANTS_CONFIG], _CONSTANTS_CONFIG, where)
    weights = _payloads(weights_config, "data/weights/", entries, where)
    constants = _payloads(constants_config, "data/constants/", entries, where)
    program = check_program(_json(entries[_PROGRAM], _PROGRAM, where), where)
    return Pt2Archive(meta, program, weights, constants, weights_config, constants_config)


def repack_pt2(archive: Pt2Archive, sample_inputs: bytes) -> bytes:
    """A fresh .pt2 (bytes) from checked content, written by torch's own archive writer:
    the archive torch then reads holds only bytes that were checked, under names torch
    wrote itself, so no two zip readers can see different content."""
    from torch.export.pt2_archive import PT2ArchiveWriter

    buffer = io.BytesIO()
    with PT2ArchiveWriter(buffer) as writer:
        writer.write_string(_PROGRAM, json.dumps(archive.program))
        for folder, payloads, config_name, config in (
            ("data/weights/", archive.weights, _WEIGHTS_CONFIG, archive.weights_config),
            ("data/constants/", archive.constants, _CONSTANTS_CONFIG, archive.constants_config),
        ):
            for payload in payloads.values():
                name = folder + payload.entry["path_name"]
                if not writer.has_record(name):  # aliases share one record
                    writer.write_bytes(name, payload.data)
            writer.write_string(config_name, json.dumps(config))
        writer.write_bytes("data/sample_inputs/model.pt", sample_inputs)
        writer.write_string(_EXTRA, json.dumps(archive.meta))
    return buffer.getvalue()
