"""Distance groups: which ternary table ``T[k]`` an arc reads (see ``graphs.crf``'s
docstring). An arc from dependent i to head j falls in a group by its direction and its
distance ``|j - i|``, bucketed by ``gamma`` (each distance up to gamma its own bucket,
then one for the rest) or by explicit cut points (the PT reference's ``dists``); arcs
touching a virtual node share one more group."""

from __future__ import annotations

import torch

from graphs.limits import LIMITS, check_length, check_size, is_integer

__all__ = ["distance_cuts", "distance_groups"]


def distance_cuts(gamma) -> tuple[int, ...]:
    """The distance buckets' cut points: ``gamma`` an integer (each distance 1..gamma its own
    bucket, then one for the rest: cuts 2..gamma + 1) or the cut points themselves, e.g.
    ``[2, 4]`` for {1}, {2, 3}, [4, inf) (the PT reference's ``dists = "2, 4"``)."""
    if isinstance(gamma, list | tuple):
        cuts = tuple(gamma)
        if any(isinstance(c, bool) or not isinstance(c, int) for c in cuts) or any(c < 2 for c in cuts):
            raise ValueError(f"gamma as distance buckets must be integers >= 2 (cut points), got {list(gamma)!r}")
        if any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"gamma as distance buckets must be strictly increasing, got {list(gamma)!r}")
        if len(cuts) > LIMITS["gamma"] or (cuts and cuts[-1] > 2**20):
            raise ValueError(f"gamma as distance buckets: at most {LIMITS['gamma']} cuts, each <= 2**20 (the limits)")
        return cuts
    check_size("gamma", gamma, minimum=0)
    return tuple(range(2, gamma + 2))


def distance_groups(n: int, gamma: int, extra_nodes: int = 0, device=None, cuts=None) -> torch.Tensor:
    """``[n + m, n + m]`` long tensor of distance groups (see ``graphs.crf``'s docstring),
    built on ``device`` (no copy from the CPU in a forward).

    ``cuts`` (distance buckets, the PT reference's ``dists``): the distances where a new
    bucket starts, increasing, each >= 2; distance |j - i| falls in bucket b = #{cuts <= it}
    of ``len(cuts) + 1 = gamma + 1`` per direction. None: ``2, 3, .., gamma + 1`` (each
    distance up to gamma its own bucket). Arcs touching one of the ``m`` virtual nodes get
    group ``2 * (gamma + 1)``; the diagonal (never an arc) gets group 0.
    """
    n, gamma, extra_nodes = (int(v) if is_integer(v) else v for v in (n, gamma, extra_nodes))  # numpy's too
    check_size("gamma", gamma, minimum=0)
    symbolic = isinstance(extra_nodes, torch.SymInt)  # while tracing for export: its value is not known yet
    if not symbolic and (not isinstance(extra_nodes, int) or isinstance(extra_nodes, bool) or extra_nodes < 0):
        raise ValueError(f"extra_nodes (virtual nodes) must be an integer >= 0, got {extra_nodes!r}")
    check_length(n, extra_nodes)  # an integer >= 1 whose [N, N] table stays within the limit
    pos = torch.arange(n, device=device)
    offset = pos[None, :] - pos[:, None]
    if cuts is None or tuple(cuts) == tuple(range(2, gamma + 2)):  # the clip: one clamp for any gamma
        clipped = offset.abs().clamp(max=gamma + 1)
    else:  # one comparison per cut, no constant tensor (an exported program keeps none)
        distance = offset.abs()
        clipped = sum((distance >= cut).long() for cut in cuts) + 1 if cuts else torch.ones_like(offset)
    token_groups = torch.where(offset > 0, clipped - 1, gamma + clipped).masked_fill(offset == 0, 0)
    # out-of-place ops only: a traced (exported) length stays symbolic
    return torch.nn.functional.pad(token_groups, (0, extra_nodes, 0, extra_nodes), value=2 * (gamma + 1))
