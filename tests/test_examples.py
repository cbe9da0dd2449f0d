import runpy


def test_concepts_example_runs_and_matches_the_engine(capsys):
    runpy.run_path("examples/concepts.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "inference.MeanField(iterations=1).logits equal: True" in out
    assert "exact log Z" in out and "<= log Z" in out
