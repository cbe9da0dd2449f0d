"""``coord_check.width_ratios`` of a result with a NaN size (a run that diverged) gives NaN for
that group: Python's max and min passed over the NaN, and the group read 1.0, perfectly flat."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from probformer.mup import coord_check

GROUPS = coord_check.ACTIVATIONS


@given(
    sizes=st.lists(st.floats(0.1, 10.0), min_size=6, max_size=6),
    width=st.sampled_from([4, 8, 16]),
    step=st.integers(0, 1),
    group=st.sampled_from(GROUPS),
)
def test_a_nan_size_gives_a_nan_ratio_for_its_group_only(sizes, width, step, group):
    values = iter(sizes)
    result = {"widths": [4, 8, 16], "steps": 1, "sizes": {}}
    for w in (4, 8, 16):
        result["sizes"][w] = {g: [1.0, 1.0] for g in GROUPS}
    result["sizes"][4]["unary"] = [next(values), next(values)]
    result["sizes"][width][group][step] = math.nan
    ratios = coord_check.width_ratios(result)
    assert math.isnan(ratios[group])
    assert all(math.isfinite(ratio) and ratio >= 1.0 for g, ratio in ratios.items() if g != group)
