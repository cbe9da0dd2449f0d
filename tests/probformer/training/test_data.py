import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.training import corpus, data, run_config


def test_ptb_is_available_offline_with_the_standard_counts():
    valid = data.ptb_sentences("valid")
    assert len(valid) == 3370
    assert sum(len(s) for s in valid) == 70390
    with pytest.raises(ValueError, match="unknown PTB split 'dev'"):
        data.ptb_sentences("dev")


def test_vocabulary_and_batches():
    sentences = [["a", "b", "a"], ["c"], ["b", "a"]]
    vocab = data.Vocabulary.build(sentences)
    assert vocab.words[:3] == ["<pad>", "<unk>", "<mask>"] and vocab.words[3] == "a"
    assert vocab.encode(["a", "zzz"]) == [3, 1]
    (tokens, mask), (tokens2, mask2) = list(data.batches(sentences, vocab, batch_size=2, max_length=3))
    assert tokens.shape == (2, 3) and mask.tolist() == [[True] * 3, [True, False, False]]
    assert tokens2.shape == (1, 2)
    with pytest.raises(ValueError, match="exceed max_length=2"):
        list(data.batches(sentences, vocab, batch_size=2, max_length=2))


def test_bert_masking_proportions():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1000, (200, 100), generator=g)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 90:] = False
    inputs, targets = data.mask_tokens(tokens, mask, 1000, generator=g)
    picked = targets != -100
    assert not picked[:, 90:].any()
    assert abs(picked[:, :90].float().mean().item() - 0.15) < 0.01
    masked = (inputs == 2) & picked
    kept = (inputs == tokens) & picked
    assert abs(masked.sum().item() / picked.sum().item() - 0.8) < 0.02
    assert abs(kept.sum().item() / picked.sum().item() - 0.1) < 0.02  # (+ rare random hits)
    assert torch.equal(targets[picked], tokens[picked])


# ---- CoNLL-U (read with the conllu package) ----

SENTENCES = """# newdoc id = d1
# sent_id = s1
# text = I don't sleep.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\tSpaceAfter=No
4.1\tslept\tsleep\tVERB\tVBD\t_\t_\t_\t4:conj\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

# a block of comments only

1\tGo\tgo\tVERB\tVB\tMood=Imp\t0\troot\t0:root\t_
"""


def test_conllu_words_skip_multiword_tokens_and_empty_nodes(tmp_path):
    path = tmp_path / "s.conllu"
    path.write_text(SENTENCES)
    first, second = data.read_conllu(path)
    assert first.words == ["I", "do", "n't", "sleep", "."]
    assert first.upos == ["PRON", "AUX", "PART", "VERB", "PUNCT"]
    assert first.heads == [4, 4, 4, 0, 4]
    assert (second.words, second.upos, second.heads) == (["Go"], ["VERB"], [0])
    path.write_bytes(SENTENCES.replace("\n", "\r\n").encode())  # Windows line ends read the same
    assert [s.words for s in data.read_conllu(path)] == [first.words, second.words]


WORD = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Z", "C")), min_size=1, max_size=6)


@st.composite
def treebank(draw):
    """Sentences and their CoNLL-U text, written here column by column, with multi-word
    tokens, empty nodes and comments drawn in between the words."""
    sentences, blocks = [], []
    for number in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 6))
        words = [draw(WORD.filter(lambda w: w not in ("_",))) for _ in range(n)]
        upos = [draw(st.sampled_from(["NOUN", "VERB", "ADP", "_"])) for _ in range(n)]
        heads = [draw(st.integers(0, n)) for _ in range(n)]
        lines = [f"# sent_id = {number}"]
        for i in range(1, n + 1):
            if i < n and draw(st.booleans()):
                lines.append(f"{i}-{i + 1}\t{words[i - 1]}{words[i]}\t_\t_\t_\t_\t_\t_\t_\t_")
            lines.append(f"{i}\t{words[i - 1]}\t_\t{upos[i - 1]}\tX\tA=B\t{heads[i - 1]}\tdep\t_\t_")
            if draw(st.booleans()):
                lines.append(f"{i}.1\tghost\t_\tNOUN\t_\t_\t_\t_\t{i}:dep\t_")
        sentences.append((words, upos, heads))
        blocks.append("\n".join(lines))
    return sentences, "\n\n".join(blocks) + "\n" * draw(st.integers(0, 2))


@given(treebank())
@settings(max_examples=40)
def test_conllu_round_trip(tmp_path_factory, case):
    sentences, text = case
    path = tmp_path_factory.mktemp("conllu") / "t.conllu"
    path.write_text(text, encoding="utf-8")
    assert [(s.words, s.upos, s.heads) for s in data.read_conllu(path)] == sentences


@pytest.mark.parametrize(
    "line,error",
    [
        ("2\tb\tb\tNOUN\tNN\t_\t1\tdep\t_", "10 tab-separated columns, got 9"),
        ("2\tb\tb\tNOUN\tNN\t_\t1\tdep\t_\t_\textra", "10 tab-separated columns, got 11"),
        ("2\tb\tb\tNOUN\tNN\t_\tone\tdep\t_\t_", "malformed CoNLL-U"),
        ("2\tb\tb\tNOUN\tNN\t_\t_\tdep\t_\t_", "ID and HEAD must be integers"),
        ("3\tb\tb\tNOUN\tNN\t_\t1\tdep\t_\t_", "expected 2, got 3"),
        ("2\tb\tb\tNOUN\tNN\t_\t7\tdep\t_\t_", "a head lies outside its sentence"),
        ("no tabs here", "malformed CoNLL-U"),
    ],
)
def test_malformed_conllu_names_the_file_and_the_sentence_line(tmp_path, line, error):
    path = tmp_path / "bad.conllu"
    path.write_text("1\ta\ta\tNOUN\tNN\t_\t0\troot\t_\t_\n\n# c\n1\ta\ta\tNOUN\tNN\t_\t0\troot\t_\t_\n" + line + "\n")
    with pytest.raises(ValueError, match=error) as caught:
        data.read_conllu(path)
    assert f"{path}:3" in str(caught.value)  # the second sentence starts on line 3


def test_conllu_without_sentences_or_file(tmp_path):
    path = tmp_path / "empty.conllu"
    path.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="holds no sentences"):
        data.read_conllu(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.read_conllu(tmp_path / "missing.conllu")


# ---- where UD English-EWT is found ----


def test_ewt_is_found_through_probformer_ewt_then_the_data_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("PROBFORMER_EWT", raising=False)
    monkeypatch.setenv("PROBFORMER_DATA", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="run `probformer data fetch ud-ewt`"):
        data.ewt_path("dev")
    cached = tmp_path / "cache" / "ud-ewt"
    cached.mkdir(parents=True)
    (cached / "en_ewt-ud-dev.conllu").write_text("")
    assert data.ewt_path("dev") == cached / "en_ewt-ud-dev.conllu"
    own = tmp_path / "own"
    own.mkdir()
    (own / "en_ewt-ud-dev.conllu").write_text("")
    monkeypatch.setenv("PROBFORMER_EWT", str(own))  # the explicit folder wins
    assert data.ewt_path("dev") == own / "en_ewt-ud-dev.conllu"
    with pytest.raises(FileNotFoundError, match="PROBFORMER_EWT"):
        data.ewt_path("test")
    with pytest.raises(ValueError, match="allowed: \\['train', 'dev', 'test'\\]"):
        data.ewt_path("valid")


def test_the_default_cache_is_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("PROBFORMER_EWT", raising=False)
    monkeypatch.delenv("PROBFORMER_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "probformer" / "ud-ewt")):
        data.ewt_path("train")


# ---- sentences longer than data.max_length: refused or cut into windows, never dropped ----

LONG_TEXT = ["a b c d e f g", "b c", "c d e f", "a", "g f e d c b a g f e d", "b b"] * 4  # 24 lines, 1 held out


def expected_windows(ids: list[int], size: int) -> list[list[int]]:
    out, rest = [], list(ids)
    while rest:
        out.append(rest[:size])
        rest = rest[size:]
    return out


@pytest.mark.parametrize("size", [1, 3, 4, 11])
def test_windows_keep_every_token_once(size):
    ids, labels = list(range(10, 21)), list(range(11))
    cut = corpus.windows(ids, labels, size)
    assert [w for w, _ in cut] == expected_windows(ids, size)
    assert [t for _, t in cut] == expected_windows(labels, size)
    assert all(t is None for _, t in corpus.windows(ids, None, size))


@given(length=st.integers(1, 40), size=st.integers(2, 12))
def test_next_token_windows_give_every_token_but_the_first_a_target_once(length, size):
    """Targets of next-token prediction, counted with the rule written here (each token of
    a window after its first is a target): the sentence's tokens 2..n once each."""
    ids = list(range(3, 3 + length))
    cut = corpus.windows(ids, None, size, "lm")
    assert all(1 <= len(w) <= size for w, _ in cut)
    targets = [token for w, _ in cut for token in w[1:]]
    assert sorted(targets) == ids[1:]


def test_next_token_windows_of_one_token_are_refused():
    with pytest.raises(ValueError, match="data.max_length >= 2"):
        corpus.windows([3, 4, 5], None, 1, "lm")


def test_long_text_lines_are_refused_or_windowed(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("\n".join(LONG_TEXT))
    vocabulary = data.Vocabulary.build([line.split() for line in LONG_TEXT])
    refused = run_config.DataConfig(source=str(path), max_length=4)
    with pytest.raises(ValueError, match="8 training sentences are longer than data.max_length=4 .longest: 11"):
        corpus.prepare_corpus(refused, vocabulary)
    windowed = run_config.DataConfig(source=str(path), max_length=4, long_sentences="windows")
    prepared = corpus.prepare_corpus(windowed, vocabulary)
    train = LONG_TEXT[:-1]  # the last line validates
    assert prepared.windowed == {"training": sum(len(s.split()) > 4 for s in train), "validation": 0}
    expected = [w for line in train for w in expected_windows(vocabulary.encode(line.split()), 4)]
    assert [ids for ids, _ in prepared.train] == expected
    assert [ids for ids, _ in prepared.valid] == [vocabulary.encode(["b", "b"])]


def test_long_ptb_sentences_are_windowed_with_the_same_words():
    config = run_config.DataConfig(
        source="ptb", max_length=8, long_sentences="windows", train_sentences=30, valid_sentences=5
    )
    sentences = data.ptb_sentences("train")[:30]
    vocabulary = data.Vocabulary.build(sentences)
    prepared = corpus.prepare_corpus(config, vocabulary)
    assert prepared.windowed["training"] == sum(len(s) > 8 for s in sentences) > 0
    assert [ids for ids, _ in prepared.train] == [
        w for s in sentences for w in expected_windows(vocabulary.encode(s), 8)
    ]


def test_long_ewt_sentences_cut_their_tags_alongside(tmp_path, monkeypatch):
    words = "the old dog saw a cat near the big red barn".split()
    upos = ["DET", "ADJ", "NOUN", "VERB", "DET", "NOUN", "ADP", "DET", "ADJ", "ADJ", "NOUN"]
    lines = [f"{i}\t{w}\t_\t{u}\t_\t_\t0\tdep\t_\t_" for i, (w, u) in enumerate(zip(words, upos), 1)]
    folder = tmp_path / "ewt"
    folder.mkdir()
    for split in ("train", "dev", "test"):
        (folder / f"en_ewt-ud-{split}.conllu").write_text(
            "\n".join(lines) + "\n\n1\tdog\t_\tNOUN\t_\t_\t0\troot\t_\t_\n"
        )
    monkeypatch.setenv("PROBFORMER_EWT", str(folder))
    config = run_config.DataConfig(source="ewt", task="pos", max_length=5, long_sentences="windows")
    prepared = corpus.prepare_corpus(config)
    tags = prepared.tags
    assert tags == sorted(set(upos))
    assert prepared.windowed == {"training": 1, "validation": 1}
    cut = [([prepared.vocabulary.words[i] for i in ids], [tags[t] for t in labels]) for ids, labels in prepared.train]
    assert cut == [(words[:5], upos[:5]), (words[5:10], upos[5:10]), (words[10:], upos[10:]), (["dog"], ["NOUN"])]
    assert prepared.valid_heads == [[0] * 11, [0]]  # whole sentences, not windows


@functools.cache
def subword_with_specials_in_its_text():
    return data.SubwordVocabulary.train(["the cat sat on the mat", "write <pad> or <mask> here"] * 4, 60)


@given(st.lists(st.sampled_from(["the", "cat", "<pad>", "<PAD>", "<mask>", "x<pad>y", "<unk>", "dog"]), max_size=12))
def test_the_literal_text_of_a_special_token_is_never_padding_or_a_mask(words):
    """ "<pad>" or "<mask>" written in the text is a word: ids 0 (padding) and 2 (a masked
    position) never come out of encode; "<unk>" (the Penn Treebank's unknown word) is <unk>."""
    vocabulary = data.Vocabulary.build([["the", "cat", "<pad>", "<mask>"]])  # the specials are not counted
    assert vocabulary.encode(words) == [{"the": 3, "cat": 4}.get(w, 1) for w in words]
    ids = subword_with_specials_in_its_text().encode(words)
    assert 0 not in ids and 2 not in ids
    assert len(ids) >= len(words)  # every word gives at least one piece


@given(st.integers(4, 120))
@settings(max_examples=8, deadline=None)
def test_a_subword_vocabulary_is_never_larger_than_asked(size):
    """WordPiece keeps every character of the text: a size below that is refused by name."""
    lines = ["the quick brown fox jumps over the lazy dog 0123456789"] * 4
    try:
        vocabulary = data.SubwordVocabulary.train(lines, size)
    except ValueError as error:
        assert f"data.vocabulary = {size} is below the" in str(error)
    else:
        assert len(vocabulary) <= size


# ---- lines that encode to nothing ----

DROPPED = "\u200b"  # a zero-width space: a line of it is not blank, but the tokenizer keeps nothing of it


@given(kept=st.lists(st.booleans(), min_size=2, max_size=40))
@settings(max_examples=25, deadline=None)
def test_a_split_whose_lines_all_encode_to_nothing_is_refused_naming_the_source(tmp_path_factory, kept):
    """Oracle: the last 1/20 of the lines validate (at least one), the rest train; a line of
    zero-width spaces encodes to no token and is left out. A split left with no sentence, or
    a vocabulary of the special tokens alone, is refused naming data.source; otherwise each
    split holds exactly its ordinary lines."""
    lines = ["the cat sat" if k else DROPPED for k in kept]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    held_out = max(1, len(lines) // data.HELD_OUT)
    train, valid = sum(kept[:-held_out]), sum(kept[-held_out:])
    config = run_config.DataConfig(source=str(path), vocabulary=40)
    if not train or not valid:
        with pytest.raises(ValueError, match=f"data.source '{path}'") as error:
            corpus.prepare_corpus(config)
        assert ("training" if not train else "validation") in str(error.value)
        assert not train or "validation" in str(error.value)
    else:
        prepared = corpus.prepare_corpus(config)
        assert (len(prepared.train), len(prepared.valid)) == (train, valid)


def test_a_vocabulary_of_the_special_tokens_alone_is_refused(tmp_path):
    """A vocabulary with no ordinary token (every word <unk>) leaves nothing to learn, and
    masking would draw its random words from an empty range."""
    path = tmp_path / "text.txt"
    path.write_text("the cat sat\n" * 40)
    specials = data.Vocabulary([data.PAD, data.UNK, data.MASK])
    with pytest.raises(ValueError, match=f"data.source '{path}'.* no token besides"):
        corpus.prepare_corpus(run_config.DataConfig(source=str(path)), specials)


# ---- what a line of a text file is ----

# Unicode line boundaries other than the newlines: str.splitlines() would cut a line at each
SEPARATORS = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@given(
    lines=st.lists(
        st.text(st.sampled_from(["a", "b", " ", "\t", "\u200b", *SEPARATORS]), max_size=8), min_size=1, max_size=8
    ),
    endings=st.lists(st.sampled_from(["\n", "\r\n", "\r"]), min_size=8, max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_a_text_file_is_cut_at_its_newlines_only(tmp_path_factory, lines, endings):
    """Oracle: the lines written, each ended by "\\n", "\\r\\n" or "\\r", come back stripped
    with the blank ones left out; a form feed, NEL or U+2028 inside a line is part of it."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_bytes("".join(line + end for line, end in zip(lines, endings)).encode("utf-8"))
    expected = [line.strip() for line in lines if line.strip()]
    if not expected:
        with pytest.raises(ValueError, match="holds no text"):
            data.text_lines(path)
    else:
        assert data.text_lines(path) == expected


def test_a_line_with_unicode_separators_is_one_sentence_of_its_words(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("the cat sat\u2028on the mat\nan\x85b\nform\x0cfeed line\n", encoding="utf-8")
    assert [line.split() for line in data.text_lines(path)] == [
        ["the", "cat", "sat", "on", "the", "mat"],
        ["an", "b"],
        ["form", "feed", "line"],
    ]
