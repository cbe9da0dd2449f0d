"""μP's coordinate check (probformer.mup.coord_check), which must be able to fail."""

import pytest

import probformer as pf
from probformer.mup import coord_check

# ---- coordinate check -------------------------------------------------------------------


@pytest.fixture(scope="module")
def coordinate_batches():
    return coord_check.fixed_batches(steps=5)


@pytest.mark.parametrize("paradigm,shape", [("channels", dict(channels=2, rank=8)), ("rank", dict(channels=2, rank=4))])
def test_coordinate_check(coordinate_batches, paradigm, shape):
    """Under μP every activation group's size differs by < 1.25x between the two widest
    widths at every step; under the standard parametrisation some group drifts > 2x
    across the sweep (so the check can fail)."""
    batches, vocab_size = coordinate_batches
    widths = [16, 32, 64, 128]
    ratios = {}
    for use_mup in (False, True):
        config = pf.PTConfig(
            vocab_size=vocab_size, labels=16, iterations=3, dropout=0.0, mup=use_mup, mup_paradigm=paradigm, **shape
        )
        result = coord_check.run(config, widths, steps=5, lr=1e-2, seeds=4, batches=batches)
        ratios[use_mup] = (coord_check.width_ratios(result, widths[-2:]), coord_check.width_ratios(result))
    widest_mup, _ = ratios[True]
    assert max(widest_mup.values()) < 1.25, widest_mup
    _, sweep_standard = ratios[False]
    assert max(sweep_standard.values()) > 2, sweep_standard


def test_widths_are_read_in_ascending_order_so_the_two_widest_are_the_last_two():
    """--widths 256,64,128 compared 64 with 128 as "the two widest" (by position)."""
    import argparse

    from probformer.mup.commands import _widths

    assert _widths("256,64,128") == [64, 128, 256]
    assert _widths("64,64,32") == [32, 64]
    with pytest.raises(argparse.ArgumentTypeError, match="two different widths"):
        _widths("64,64")
