"""``coord_check.run``'s own arguments are refused by name before any model is built:
seeds=0 averaged nothing and reported every size as 0.0, an empty list of widths gave an
empty result, more steps than batches failed with an IndexError after training, and a
huge step count built batches without end."""

from __future__ import annotations

import math

import pytest

import probformer as pf
from probformer.mup import coord_check

CONFIG = pf.PTConfig(vocab_size=11, labels=4, channels=2, rank=2, iterations=1, dropout=0.0)


def never_read():
    raise AssertionError("the batches were built")


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ({"widths": []}, "widths must be a non-empty list of integers"),
        ({"widths": "16"}, "widths must be a non-empty list of integers"),
        ({"seeds": 0}, "seeds must be an integer >= 1"),
        ({"seeds": True}, "seeds must be an integer >= 1"),
        ({"seeds": 2.5}, "seeds must be an integer >= 1"),
        ({"steps": -1}, "steps must be an integer >= 0"),
        ({"steps": 10**9}, r"steps must be an integer >= 0 and <= 10000"),
        ({"steps": 2.0}, "steps must be an integer >= 0"),
        ({"lr": 0.0}, "lr must be a finite number > 0"),
        ({"lr": math.nan}, "lr must be a finite number > 0"),
        ({"lr": "1e-2"}, "lr must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_anything_runs(arguments, words, monkeypatch):
    monkeypatch.setattr(coord_check, "fixed_batches", lambda *a, **k: never_read())
    values = {"widths": [4, 8], "steps": 1, "lr": 1e-2, "seeds": 1} | arguments
    with pytest.raises(ValueError, match=words):
        coord_check.run(CONFIG, values.pop("widths"), **values)


def test_more_steps_than_batches_are_refused_by_name():
    """One batch is measured before each step and one after the last."""
    batches = [None] * 3
    with pytest.raises(ValueError, match=r"steps must be at most 2 \(the batches there are\), got 3"):
        coord_check.run(CONFIG, [4], steps=3, seeds=1, batches=batches)
