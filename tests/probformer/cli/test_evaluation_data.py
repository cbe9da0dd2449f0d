"""The data ``evaluate`` reads: ``--split`` of a text source gives the trainer's splits,
long sentences are scored in windows rather than dropped, and the earlier ``--data
ptb-test`` spelling is ``--data ptb --split test``, as for diagnose."""

import pytest
import torch

from probformer import cli
from probformer.training import checkpoint, corpus, data, run_config
from probformer.training import evaluate as evaluation

# ---- --split of a text source; long sentences ------------------------------------------------


def test_text_splits_are_the_trainers(tmp_path):
    lines = [f"sentence {i} has words w{i % 7} and w{i % 5}" for i in range(45)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(lines) + "\n")
    # 45 lines: 45 // 20 = 2 held out for validation
    assert evaluation.read_split(str(text), "valid") == ([line.split() for line in lines[43:]], "valid")
    assert evaluation.read_split(str(text), "train") == ([line.split() for line in lines[:43]], "train")
    assert evaluation.read_split(str(text), None) == ([line.split() for line in lines], "all")
    with pytest.raises(ValueError, match="no test split"):
        evaluation.read_split(str(text), "test")
    with pytest.raises(ValueError, match="--split all is for a text file"):
        evaluation.read_split("ptb", "all")
    trained = corpus.prepare_corpus(run_config.DataConfig(source=str(text), vocabulary=60))
    valid, _ = evaluation.read_split(str(text), "valid")
    assert [ids for ids, _ in trained.valid] == [trained.vocabulary.encode(words) for words in valid]


def test_long_sentences_are_scored_in_windows_not_dropped(tmp_path):
    words = [f"w{i}" for i in range(20)]
    vocabulary = data.Vocabulary.build([words])
    torch.manual_seed(0)
    model = cli_model(len(vocabulary), max_length=8)
    checkpoint.save(model, tmp_path / "model", vocabulary)
    (tmp_path / "long.txt").write_text(" ".join(words) + "\n")  # 20 words: windows of 8, 8 and 4
    (tmp_path / "cut.txt").write_text("\n".join(" ".join(words[i : i + 8]) for i in (0, 8, 16)) + "\n")
    long = evaluation.evaluate(tmp_path / "model", "mlm", str(tmp_path / "long.txt"))
    cut = evaluation.evaluate(tmp_path / "model", "mlm", str(tmp_path / "cut.txt"))
    assert long["sentences"] == 1 and long["windowed"] == 1 and cut["windowed"] == 0
    assert long["loss"] == cut["loss"] and long["tokens"] == cut["tokens"] > 0


def cli_model(vocab_size: int, max_length: int):
    import probformer as pf

    config = pf.TransformerConfig(
        vocab_size=vocab_size, width=8, heads=2, layers=1, ffn_width=16, max_length=max_length
    )
    return pf.Transformer(config).eval()


def test_old_data_spelling_is_the_new():
    assert cli._old_data_spelling("ptb-valid", None) == ("ptb", "valid")
    assert cli._old_data_spelling("ptb-test", "test") == ("ptb", "test")
    assert cli._old_data_spelling("ptb", None) == ("ptb", None)
    with pytest.raises(ValueError, match="disagree"):
        cli._old_data_spelling("ptb-valid", "test")


def test_evaluate_reads_the_earlier_data_spelling_as_diagnose_does(tmp_path, monkeypatch, capsys):
    """--data ptb-test is --data ptb --split test (it reached the loader as a path)."""
    from probformer.training import evaluate as evaluation

    asked = []
    monkeypatch.setattr(evaluation, "evaluate", lambda *args: asked.append(args) or {"loss": 1.0})
    monkeypatch.setattr(evaluation, "print_table", lambda task, metrics: None)
    assert cli.main(["evaluate", str(tmp_path), "--task", "mlm", "--data", "ptb-test"]) == 0
    assert asked == [(str(tmp_path), "mlm", "ptb", "test", 0)]
    assert "mlm on ptb (test):" in capsys.readouterr().out
