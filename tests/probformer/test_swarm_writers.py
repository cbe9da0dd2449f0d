"""SwarmFormer's writers (``_top_fraction``): each row's ceil(p * real) most confident real
tokens, ties in position order, against a sort of (confidence, position) pairs written here."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.models.swarmformer import _top_fraction


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.booleans()), min_size=1, max_size=30),
        min_size=1,
        max_size=3,
    ),
    fraction=st.floats(0.01, 1.0),
)
def test_writers_are_the_most_confident_real_tokens(rows, fraction):
    n = max(len(row) for row in rows)
    confidence = torch.zeros(len(rows), n)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, row in enumerate(rows):
        for i, (value, real) in enumerate(row):
            confidence[b, i], mask[b, i] = value, real
        if not mask[b].any():
            mask[b, 0] = True  # every row has a real token
    got = _top_fraction(confidence, mask, fraction)
    for b in range(len(rows)):
        real = [i for i in range(n) if mask[b, i]]
        keep = int(torch.ceil(torch.tensor(fraction) * len(real)))  # the model's own float32 rounding of p * real
        chosen = sorted(real, key=lambda i: (-confidence[b, i].item(), i))[:keep]
        assert got[b].nonzero().flatten().tolist() == sorted(chosen)
