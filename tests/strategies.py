"""Hypothesis strategies: tiny CRFs and batches (n <= 4, d <= 3, C <= 2), scaled CRFs, head-kernel problems."""

import torch
from hypothesis import strategies as st

import graphs

TOPOLOGIES = [
    "full",
    "causal",
    "window(1)",
    "window(2)",
    "star()",
    "clusters(2)",
    "segments(2)",
    "window(1) | star()",
    "clusters(2, dynamic=True)",
    "segments(2, causal=True)",
]


@st.composite
def tiny_crfs(draw, max_len=4, max_labels=3, max_channels=2, topologies=TOPOLOGIES, max_virtual=2):
    topo = graphs.topology.parse(draw(st.sampled_from(topologies)))
    n = draw(st.integers(1, max_len))
    d = draw(st.integers(1, max_labels))
    if topo.extra_nodes >= 2:  # keep labels ** nodes small
        n, d = min(n, 3), min(d, 2)
    crf = graphs.CRF(
        vocab_size=draw(st.integers(2, 6)),
        labels=d,
        channels=draw(st.integers(1, max_channels)),
        rank=draw(st.integers(1, 3)),
        global_labels=draw(st.sampled_from([0, 0, 2, 3])),
        topology=topo,
        gamma=draw(st.integers(0, 3)),
    )
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.5, 1.0, 2.0]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    B = draw(st.integers(1, 2))
    tokens = torch.randint(0, crf.vocab_size, (B, n), generator=gen)
    lengths = [draw(st.integers(1, n)) for _ in range(B)]
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return crf, tokens, mask


@st.composite
def scaled_crfs(draw):
    topology = draw(st.sampled_from(["full", "causal", "window(1)", "star()", "clusters(1)", "segments(2)"]))
    n = draw(st.integers(1, 3))
    crf = graphs.CRF(
        vocab_size=4,
        labels=2,
        channels=1,
        rank=2,
        global_labels=draw(st.sampled_from([0, 2])),
        topology=topology,
        gamma=draw(st.integers(0, 2)),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    potential = draw(st.sampled_from([1.0, 10.0, 100.0, 1e3, 1e4]))
    with torch.no_grad():
        for p in crf.parameters():  # float32 parameters of +-potential
            p.copy_(torch.randn(p.shape, generator=gen) * potential)
    tokens = torch.randint(0, 4, (2, n), generator=gen)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, draw(st.integers(1, n)) :] = False
    return crf, tokens, mask


# Random head-kernel problems: seeded inputs of n nodes, score scales, a share of illegal arcs.
HEAD_PROBLEMS = dict(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 9),
    scale=st.sampled_from([1.0, 30.0, 1e3]),
    illegal=st.floats(0.0, 0.9),
)
