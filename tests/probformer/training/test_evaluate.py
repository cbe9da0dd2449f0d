"""probformer.training.evaluate: POS accuracy and head attachment scores of a trained run on
a tiny treebank, and attachment scores of hand-built head posteriors whose scores are known."""

import pytest
import torch

from probformer.training.evaluate import attachment_scores, evaluate
from probformer.training.trainer import train
from tests.builders import write_tiny_run_config as write_config

CONLLU = """# text = tiny
1\tdogs\tdog\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tbark\tbark\tVERB\tVBP\t_\t0\troot\t_\t_
3\tloudly\tloudly\tADV\tRB\t_\t2\tadvmod\t_\t_

1\tcats\tcat\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tsleep\tsleep\tVERB\tVBP\t_\t0\troot\t_\t_

"""


@pytest.fixture
def tiny_ewt(tmp_path, monkeypatch):
    folder = tmp_path / "ewt"
    folder.mkdir()
    for split in ("train", "dev", "test"):
        (folder / f"en_ewt-ud-{split}.conllu").write_text(CONLLU * 20)
    monkeypatch.setenv("PROBFORMER_EWT", str(folder))
    return folder


def test_pos_tagging_and_attachment_scores(tmp_path, tiny_ewt):
    config = write_config(tmp_path, source="ewt", task="pos", max_length=10, steps=30)
    text = config.read_text().replace("iterations = 2", 'iterations = 2\ntopology = "full | root()"')
    config.write_text(text.replace("lr = 3e-3", "lr = 3e-2"))
    train(config, tmp_path / "run", progress=False)
    pos = evaluate(tmp_path / "run", "pos", "ewt")
    assert pos["tokens"] == 20 * 5  # every word of the dev file
    assert pos["accuracy"] > 0.9  # four words, four tags: learnable in 30 steps
    uas = evaluate(tmp_path / "run", "uas", "ewt")
    assert uas["words"] == 5 * 20 and uas["root_node"]
    assert len(uas["per_channel"]) == 2 and 0 <= uas["mean"] <= uas["best_channel"] <= 1
    # the neighbour baselines are exact on this data: 'dogs'/'cats' head right, 'loudly' left
    assert uas["right_neighbour_baseline"] == pytest.approx(2 / 5)
    assert uas["left_neighbour_baseline"] == pytest.approx(1 / 5)
    # whole trees are never cut: a run window below their length leaves none out of uas (the PT
    # reads any length), where the window had left out every 3-word tree
    import json

    record = json.loads((tmp_path / "run" / "run.json").read_text())
    record["data"]["max_length"] = 2
    (tmp_path / "run" / "run.json").write_text(json.dumps(record))
    again = evaluate(tmp_path / "run", "uas", "ewt")
    assert again["words"] == 5 * 20 and again["skipped_too_long"] == 0


def test_pos_reads_the_tags_of_every_folder_a_tagger_is_stored_in(tmp_path, tiny_ewt):
    """A checkpoint keeps its tags in training.json and a torch export copies tags.json:
    both score exactly as the run's model/ does (the same weights). A tags.json that does
    not give one distinct tag per class is refused naming the file."""
    import json
    import shutil

    import probformer
    from probformer.training.run_checkpoints import latest_checkpoint

    config = write_config(tmp_path, source="ewt", task="pos", max_length=10, steps=2)
    train(config, tmp_path / "run", progress=False)
    expected = evaluate(tmp_path / "run", "pos", "ewt")
    exported = probformer.export(tmp_path / "run", tmp_path / "export")
    assert (exported / "tags.json").read_text() == (tmp_path / "run" / "model" / "tags.json").read_text()
    for folder in (latest_checkpoint(tmp_path / "run"), exported):
        assert evaluate(folder, "pos", "ewt") == expected
    tags = json.loads((tmp_path / "run" / "model" / "tags.json").read_text())
    for written in (["AAA", *tags], tags[:-1], [*tags[:-1], tags[0]], "not json"):
        edited = shutil.copytree(tmp_path / "run" / "model", tmp_path / "edited", dirs_exist_ok=True)
        (edited / "tags.json").write_text(written if isinstance(written, str) else json.dumps(written))
        with pytest.raises(ValueError, match=str(edited / "tags.json")):
            evaluate(edited, "pos", "ewt")


class FixedHeads(torch.nn.Module):
    """A stand-in PT for attachment_scores: ``channels`` head channels, these virtual nodes,
    and head marginals ``heads(B, n)`` [B, C, N, N] written by the test."""

    def __init__(self, channels: int, virtual: tuple, heads):
        super().__init__()
        self.mean_field, self.heads = True, heads
        self.crf = type("C", (), {"channels": channels, "topology": type("T", (), {"virtual": virtual})()})()

    def forward(self, tokens, mask):
        return None, type("P", (), {"h": self.heads(*tokens.shape)})()


def test_attachment_scores_of_a_known_posterior(tiny_ewt):
    """A model whose head posterior is 'the next word' scores exactly the right-neighbour
    baseline on the channel that says so."""
    from probformer.training import data

    def next_word(B, n):
        heads = torch.zeros(B, 1, n, n)
        heads[:, 0, torch.arange(n - 1), torch.arange(1, n)] = 1
        return heads

    vocabulary = data.Vocabulary.build([["dogs", "bark"]])
    trees = data.read_conllu(tiny_ewt / "en_ewt-ud-dev.conllu")
    scores = attachment_scores(FixedHeads(1, (), next_word), vocabulary, trees)
    assert scores["best_channel"] == pytest.approx(scores["right_neighbour_baseline"])


def test_attachment_scores_count_only_the_root_node_as_root(tiny_ewt):
    """star() | root(): virtual node n is the relay, n + 1 ROOT. A channel that always picks
    the relay scores 0 (it used to be credited with every gold root); one that always picks
    ROOT scores the share of words whose gold head is 0."""
    from probformer.training import data

    def relay_then_root(B, n):
        heads = torch.zeros(B, 2, n + 2, n + 2)
        heads[:, 0, :, n] = 1  # the relay
        heads[:, 1, :, n + 1] = 1  # ROOT
        return heads

    vocabulary = data.Vocabulary.build([["dogs", "bark"]])
    trees = data.read_conllu(tiny_ewt / "en_ewt-ud-dev.conllu")
    roots = sum(head == 0 for tree in trees for head in tree.heads)
    words = sum(len(tree.heads) for tree in trees)
    scores = attachment_scores(FixedHeads(2, ("relay", "root"), relay_then_root), vocabulary, trees)
    assert roots > 0 and scores["per_channel"] == pytest.approx([0.0, roots / words])


def test_a_word_with_no_legal_head_is_never_credited_with_one():
    """Channel 0's head rows are all zero (no legal head: argmax would read node 0, word 1);
    channel 1 gives words 2 and 4 the head word 1 and leaves words 1 and 3 without one. Gold:
    words 2, 3 and 4 depend on word 1 (4 words): 0 and 2 / 4."""
    from probformer.training import data

    def some_heads(B, n):
        heads = torch.zeros(B, 2, n, n)
        heads[:, 1, [1, 3], 0] = 1.0
        return heads

    words = ["a", "b", "c", "d"]
    tree = data.TreebankSentence(words=words, upos=["X"] * 4, heads=[0, 1, 1, 1])
    scores = attachment_scores(FixedHeads(2, (), some_heads), data.Vocabulary.build([words]), [tree])
    assert scores["per_channel"] == pytest.approx([0.0, 0.5])


def test_tags_the_model_never_saw_are_refused_by_name(tiny_ewt):
    """A word whose gold tag has no output could only be left out of the accuracy (it was)."""
    from probformer.training import data
    from probformer.training.evaluate import encode_windows

    trees = data.read_conllu(tiny_ewt / "en_ewt-ud-dev.conllu")
    vocabulary = data.Vocabulary.build([["dogs", "bark"]])
    with pytest.raises(ValueError, match=r"tags the model was not trained on: \['ADV', 'VERB'\]"):
        encode_windows(trees, vocabulary, 10, tags=["NOUN"])
    examples, _ = encode_windows(trees, vocabulary, 10, tags=["ADV", "NOUN", "VERB"])
    assert [labels for _, labels in examples[:2]] == [[1, 2, 0], [1, 2]]


def test_mlm_evaluation_masks_at_the_rate_the_run_trained_with(tmp_path):
    """Read from run.json wherever the model was found in the run; 15% for a bare folder."""
    import json

    from probformer.training.evaluate import _trained_mask_rate

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "checkpoints" / "step-0000004").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"data": {"mask_rate": 0.5}}))
    for where in (run, run / "model", run / "checkpoints" / "step-0000004"):
        assert _trained_mask_rate(where) == 0.5
    (tmp_path / "bare").mkdir()
    assert _trained_mask_rate(tmp_path / "bare") == 0.15
    (run / "run.json").write_text(json.dumps({"data": {}}))  # a run that says nothing is not the default
    with pytest.raises(ValueError, match="records no readable data.mask_rate"):
        _trained_mask_rate(run / "model")


@pytest.mark.parametrize(
    "cwd, relative",
    [
        ("checkpoints", "step-0000004"),
        ("checkpoints/step-0000004", "."),
        ("model", "."),
        ("checkpoints", "../model"),
        ("", "model"),
    ],
)
def test_the_trained_mask_rate_is_found_from_a_relative_path(tmp_path, monkeypatch, cwd, relative):
    import json

    from probformer.training.evaluate import _trained_mask_rate

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "checkpoints" / "step-0000004").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"data": {"mask_rate": 0.3}}))
    monkeypatch.chdir(run / cwd)
    assert _trained_mask_rate(relative) == 0.3


def test_evaluate_cuts_long_sentences_where_the_run_did_and_gives_its_final_validation(tmp_path):
    """With data.long_sentences = "windows" the trainer validates on windows of
    data.max_length; evaluate cut at the model's max_length (none for a PT), so it scored
    other examples: another loss and token count for the same model and split."""
    text = tmp_path / "corpus.txt"
    words = [f"w{i % 23}" for i in range(2000)]
    lengths = [3 + (k * 7) % 17 for k in range(200)]  # 3 to 19 words: some past max_length = 8
    lines, start = [], 0
    for length in lengths:
        lines.append(" ".join(words[start : start + length]))
        start = (start + length) % 1500
    text.write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path, source=str(text), max_length=8, steps=4)
    config.write_text(config.read_text().replace("[data]", '[data]\nlong_sentences = "windows"'))
    summary = train(config, tmp_path / "run", progress=False)
    found = evaluate(tmp_path / "run" / "model", "mlm", str(text), "valid")
    assert found["windowed"] > 0
    assert found["tokens"] == summary["valid"]["tokens"]
    assert found["loss"] == pytest.approx(summary["valid"]["loss"], rel=1e-9)
