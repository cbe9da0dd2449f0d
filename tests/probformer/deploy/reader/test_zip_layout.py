"""Zip structure: only exactly the layout torch writes is read. Odd entry names, duplicates,
extra or missing entries, symlink attributes, bytes no entry owns, compression, empty and
foreign files are refused; the strict zip reader reads torch's archives as ``zipfile`` does;
a missing path raises ``FileNotFoundError``."""

import zipfile

import pytest

from probformer.deploy import archive
from tests.probformer.deploy.reader.artefacts import assert_refused
from tests.probformer.deploy.reader.crafting import entries_of, write_plain_zip


def valid_items(artefacts):
    return list(entries_of(artefacts["pt2"]).items())


ZIP_CASES = {
    "parent folder": (lambda items: [("../evil", b"x")] + items, "not a plain relative path"),
    "absolute name": (lambda items: [("/etc/evil", b"x")] + items, "not a plain relative path"),
    "backslash": (lambda items: [("model\\..\\evil", b"x")] + items, "not a plain relative path"),
    "dot folder": (lambda items: [("model/./evil", b"x")] + items, "not a plain relative path"),
    "duplicate": (lambda items: items + [items[0]], "duplicate archive entry"),
    "extra entry": (lambda items: items + [("model/data/weights/evil.pkl", b"x")], "unexpected archive entry"),
    "two roots": (lambda items: items + [("other/archive_format", b"pt2")], "one root folder"),
    "no program": (lambda items: [i for i in items if not i[0].endswith("model.json")], "missing entries"),
}


@pytest.mark.parametrize("case", sorted(ZIP_CASES))
def test_archives_not_in_our_layout_are_refused(tmp_path, artefacts, case):
    change, fragment = ZIP_CASES[case]
    assert_refused(write_plain_zip(tmp_path / "case.pt2", change(valid_items(artefacts))), fragment)


def test_symlinks_hidden_bytes_and_compression_are_refused(tmp_path, artefacts):
    items = valid_items(artefacts)
    symlink = write_plain_zip(tmp_path / "link.pt2", items, external_attr=(0o120777 << 16))
    assert_refused(symlink, "file attributes")
    assert_refused(write_plain_zip(tmp_path / "tail.pt2", items, tail=b"hidden"), "end record")
    data = write_plain_zip(tmp_path / "plain.pt2", items).read_bytes()
    (tmp_path / "head.pt2").write_bytes(b"PK\x03\x04" + data)  # the directory's offset is now wrong
    assert_refused(tmp_path / "head.pt2", "between the central directory and the end record")
    assert_refused(write_plain_zip(tmp_path / "gap.pt2", items, gap=b"hidden"), "not where the previous one ended")
    with zipfile.ZipFile(tmp_path / "deflated.pt2", "w", zipfile.ZIP_DEFLATED) as out:
        for name, content in items:
            out.writestr(name, content)
    assert_refused(tmp_path / "deflated.pt2", "compressed")
    with zipfile.ZipFile(tmp_path / "foreign.pt2", "w") as out:
        out.writestr("hello.txt", "a zip that is not a model")
    assert_refused(tmp_path / "foreign.pt2")


def test_the_strict_reader_reads_torch_archives_as_zipfile_does(artefacts):
    data = artefacts["pt2"].read_bytes()
    assert archive.read_zip(data, "model.pt2") == entries_of(artefacts["pt2"])


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04", b"PK\x03\x04" + b"\0" * 100, b"not a model", b"\x08\x01"])
@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_empty_and_foreign_files_are_refused(tmp_path, content, suffix):
    path = tmp_path / f"file{suffix}"
    path.write_bytes(content)
    assert_refused(path)


def test_missing_paths_raise_file_not_found(tmp_path):
    assert_refused(tmp_path / "nothing.pt2", error=FileNotFoundError)
    (tmp_path / "folder").mkdir()
    assert_refused(tmp_path / "folder", error=FileNotFoundError)
