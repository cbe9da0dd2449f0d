import json
import re
import runpy
import sys

import torch

from probformer.deploy import load


def test_concepts_example_runs_and_matches_the_engine(capsys):
    runpy.run_path("examples/concepts.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "inference.MeanField(iterations=1).logits equal: True" in out
    assert "exact log Z" in out and "<= log Z" in out


TINY_EWT = """# text = dogs bark loudly
1\tdogs\tdog\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tbark\tbark\tVERB\tVBP\t_\t0\troot\t_\t_
3\tloudly\tloudly\tADV\tRB\t_\t2\tadvmod\t_\t_

1\tcats\tcat\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tsleep\tsleep\tVERB\tVBP\t_\t0\troot\t_\t_

"""


def test_pos_tagger_example_trains_exports_and_reloads(tmp_path, monkeypatch, capsys):
    """examples/pos_tagger.py --quick on a two-sentence treebank: the dev accuracy it prints
    is the one its exported tagger gets here, from the words and tags of the file."""
    folder = tmp_path / "ewt"
    folder.mkdir()
    for split in ("train", "dev"):
        (folder / f"en_ewt-ud-{split}.conllu").write_text(TINY_EWT * 20)
    monkeypatch.setenv("PROBFORMER_EWT", str(folder))
    monkeypatch.setattr(sys, "argv", ["pos_tagger.py", "--quick", "--formats", "torch", "--out", str(tmp_path / "out")])
    runpy.run_path("examples/pos_tagger.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "torch: " in out and "reloaded, tags equal: True" in out
    printed = float(re.search(r"dev UPOS accuracy ([0-9.]+) \(32 sentences, pairwise='chain\(\)'", out).group(1))

    tagger = load(tmp_path / "out" / "tagger")
    index = {
        word: i for i, word in enumerate(json.loads((tmp_path / "out" / "tagger" / "vocabulary.json").read_text()))
    }
    tags = ["ADV", "NOUN", "VERB"]  # the tags of the training file, sorted
    sentences = [(["dogs", "bark", "loudly"], ["NOUN", "VERB", "ADV"]), (["cats", "sleep"], ["NOUN", "VERB"])] * 16
    correct = 0
    for words, gold in sentences:
        with torch.no_grad():
            predicted = tagger(torch.tensor([[index[w] for w in words]]), torch.ones(1, len(words), dtype=torch.bool))
        correct += sum(tags[int(p)] == g for p, g in zip(predicted[0].argmax(-1), gold))
    assert abs(printed - correct / 80) < 1e-4  # printed to four decimals
