"""``data.source = "hf:..."``: lines of text from a Hugging Face ``datasets`` dataset, for
MLM (and next-token) training. Two forms, both local (nothing is downloaded here):

- ``hf:DIR`` -- a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``;
- ``hf:BUILDER:FILES`` -- a packaged builder (``text``, ``json``, ``csv``, ``parquet``) on
  local files, ``FILES`` a path or a glob, e.g. ``hf:text:corpus/*.txt``.

The text is the column ``text``, or the dataset's only string column. Splits: a
``DatasetDict`` gives ``train`` and, when present, ``validation`` (or ``valid`` / ``dev``;
two of these are refused) and ``test``; a single dataset is ``train`` (without a
validation split, ``data.text_splits`` holds out the last 5% of ``train``, as for a text
file). A Hub dataset is used by saving it first:
``datasets.load_dataset(NAME).save_to_disk(DIR)``, then ``hf:DIR``. ``datasets`` is the
optional extra ``probformer[hf]``, imported only when such a source is read."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

__all__ = ["PREFIX", "BUILDERS", "is_hf_source", "hf_splits"]

PREFIX = "hf:"
BUILDERS = ("text", "json", "csv", "parquet")
_VALID_NAMES = ("validation", "valid", "dev")


def is_hf_source(source) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def hf_splits(source: str) -> dict[str, list[str]]:
    """``{"train": lines[, "valid": lines][, "test": lines]}``: the non-empty, stripped
    lines of the text column of each split of the dataset named by ``source``."""
    if not is_hf_source(source):
        raise ValueError(f"a Hugging Face source starts with {PREFIX!r}, got {source!r}")
    loaded = _load(source)
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        named = {name: _lines(source, name, split) for name, split in loaded.items()}
    else:
        named = {"train": _lines(source, "train", loaded)}
    if "train" not in named:
        raise ValueError(f"data.source {source!r} has no 'train' split; it has {sorted(named)}")
    unknown = sorted(set(named) - {"train", "test", *_VALID_NAMES})
    if unknown:  # a split that is none of these would be read nowhere
        raise ValueError(
            f"data.source {source!r} has splits {unknown} that are none of 'train', 'test' or the validation "
            f"names {list(_VALID_NAMES)}; rename them (DatasetDict keys) so that none is left out"
        )
    valid = [name for name in _VALID_NAMES if name in named]
    if len(valid) > 1:  # one would validate and the others be read nowhere
        raise ValueError(
            f"data.source {source!r} has validation splits {sorted(valid)}: keep one of them (merge or remove "
            "the others: DatasetDict keys), so that none is left out"
        )
    splits = {"train": named["train"]}
    if valid:
        splits["valid"] = named[valid[0]]
    if "test" in named:
        splits["test"] = named["test"]
    return splits


def _load(source: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data.source {source!r} needs the Hugging Face datasets package: pip install 'probformer[hf]'"
        ) from None
    spec = source[len(PREFIX) :]
    if not spec:
        raise ValueError(f"data.source {source!r}: write hf:DIR or hf:BUILDER:FILES (docs/data.md)")
    builder, separator, files = spec.partition(":")
    spec, files = os.path.expanduser(spec), os.path.expanduser(files)
    quiet = not sys.stderr.isatty()  # progress bars on a terminal only
    was_enabled = datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        if separator and builder in BUILDERS:
            if not files or not any(glob.iglob(files, recursive=True)):
                raise FileNotFoundError(f"data.source {source!r}: no file matches {files!r}")
            return datasets.load_dataset(builder, data_files=files)
        if separator and not Path(spec).exists() and len(builder) > 1:  # "C:\\..." is a Windows path, not a builder
            raise ValueError(
                f"data.source {source!r}: unknown builder {builder!r}; allowed: {list(BUILDERS)} "
                f"(hf:BUILDER:FILES), or hf:DIR for a folder written by save_to_disk"
            )
        if not Path(spec).is_dir():
            raise FileNotFoundError(
                f"data.source {source!r}: {spec!r} is not a folder written by save_to_disk "
                f"(for files, write hf:BUILDER:FILES with BUILDER one of {list(BUILDERS)})"
            )
        try:
            return datasets.load_from_disk(spec)
        except FileNotFoundError as error:  # a folder, but not a saved dataset
            raise ValueError(f"data.source {source!r}: {spec} is not a saved dataset: {error}") from None
    finally:
        if quiet and was_enabled:
            datasets.enable_progress_bars()


def _lines(source: str, name: str, split) -> list[str]:
    columns = split.column_names
    strings = [c for c in columns if getattr(split.features[c], "dtype", None) in ("string", "large_string")]
    if "text" in columns:
        column = "text"
    elif len(strings) == 1:
        column = strings[0]
    else:
        raise ValueError(
            f"data.source {source!r} split {name!r}: no 'text' column and not exactly one string column "
            f"(columns: {columns}); name the text column 'text'"
        )
    values = split[column]
    if any(value is not None and not isinstance(value, str) for value in values):
        raise ValueError(f"data.source {source!r} split {name!r}: column {column!r} holds non-text values")
    return [value.strip() for value in values if value and value.strip()]
