"""The data files of a model folder, read as untrusted data (``probformer.models.pretrained``
reads the folder through them, ``probformer.load`` its other formats' JSON):

    read_bytes(path, limit, what)        a regular file's bytes, its size checked before reading
    read_json(path)                      JSON, a key given twice in one object refused
    check_vocabulary(files, vocab_size)  vocabulary.json and tokenizer.json against the model
                                         and each other

Every error is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

__all__ = ["read_bytes", "read_json", "check_vocabulary", "LIMITS"]

# bytes read at most, checked on the file's size before reading it
LIMITS = {"json": 64 << 20, "safetensors": 16 << 30}


def read_bytes(path: Path, limit: int, what: str) -> bytes:
    """The content of a regular file of at most ``limit`` bytes, checked on its size
    before it is read."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if info.st_size > limit:
        raise ValueError(f"{path}: {info.st_size} bytes; a {what} file may have at most {limit}")
    if info.st_size == 0:
        raise ValueError(f"{path} is empty")
    return path.read_bytes()


def read_json(path: Path):
    """A model folder's JSON; a key given twice in one object is refused (readers disagree on
    which value wins)."""

    def unique(pairs):
        found = dict(pairs)
        if len(found) < len(pairs):
            raise ValueError(f"{path} gives a key more than once in one object ({len(pairs) - len(found)} repeats)")
        return found

    try:
        return json.loads(read_bytes(path, LIMITS["json"], "json").decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def check_vocabulary(files: dict[str, Path], vocab_size: int) -> None:
    """``vocabulary.json`` is ``vocab_size`` strings; a ``tokenizer.json`` beside it must give
    exactly those pieces (id -> piece): a tokenizer from another run, or none for a subword
    model, would encode every text into other ids without any other error."""
    words = None
    if "vocabulary.json" in files:
        words = read_json(files["vocabulary.json"])
        if not (isinstance(words, list) and all(isinstance(w, str) for w in words)):
            raise ValueError(f"{files['vocabulary.json']}: a vocabulary is a JSON list of strings")
        if len(words) != vocab_size:
            raise ValueError(f"{files['vocabulary.json']}: {len(words)} words, but vocab_size is {vocab_size}")
    if "tokenizer.json" in files:
        _check_tokenizer(files["tokenizer.json"], words, files.get("vocabulary.json"), vocab_size)
    elif words is not None:
        # WordPiece keeps every character that continues a word as "##c": a word vocabulary
        # holds such a word only if the text did, a subword one always does
        pieces = [w for w in words if len(w) == 3 and w.startswith("##")]
        if pieces:
            raise ValueError(
                f"{files['vocabulary.json']} holds WordPiece continuation pieces ({pieces[:3]}) but the folder has "
                "no tokenizer.json: a subword model encodes only with the tokenizer it was trained with; put it back"
            )


def _check_tokenizer(path: Path, words: list[str] | None, vocabulary: Path | None, vocab_size: int) -> None:
    """The tokenizer's pieces, read by the ``tokenizers`` library (JSON data: nothing in it
    is run), equal to ``words`` (vocabulary.json) when given, and ``vocab_size`` of them."""
    from tokenizers import Tokenizer

    if not isinstance(read_json(path), dict):
        raise ValueError(f"{path}: a tokenizer file is a JSON object")
    try:
        tokenizer = Tokenizer.from_str(read_bytes(path, LIMITS["json"], "json").decode("utf-8"))
    except Exception as error:  # tokenizers raises its own exception types
        raise ValueError(f"{path} is not a tokenizers JSON file: {error}") from None
    pieces = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    if len(pieces) != vocab_size:
        raise ValueError(f"{path}: {len(pieces)} pieces, but vocab_size is {vocab_size}")
    if words is not None and pieces != words:
        first = next(i for i, (piece, word) in enumerate(zip(pieces, words)) if piece != word)
        raise ValueError(
            f"{path} is not the tokenizer of {vocabulary}: id {first} is {pieces[first]!r} in one and "
            f"{words[first]!r} in the other (a tokenizer from another run encodes into other ids)"
        )
