"""The CRF as a Pyro model (``CRF.model``): the label sites, then each factor template
writes its sites (``graphs.factors``) from a ``ModelScope``. Pyro is imported when a
model is written, never when this module is: the tensors a trained model needs run
without it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ModelScope", "write_model"]


@dataclass
class ModelScope:
    """What templates read while they write ``CRF.model``: the checked inputs (token ids
    ``[B, n]`` or embeddings ``[B, n, D]``), their mask, the node and arc masks, the unary
    table ``[B, N, d]``, and the label sites ``z`` (one per node, enumerated or sampled)."""

    inputs: torch.Tensor
    mask: torch.Tensor
    nodes: torch.Tensor
    arcs: torch.Tensor
    unary: torch.Tensor
    z: list = field(default_factory=list)


def write_model(crf, inputs: torch.Tensor, mask: torch.Tensor) -> None:
    """The sites of ``crf``'s model on checked ``inputs`` and ``mask``: one uniform
    ``Categorical`` label site per node, then every template's sites (``crf.templates()``)."""
    import pyro  # the declaration needs Pyro; the tensors (potentials, masks) do not
    import pyro.distributions as dist

    B, n = mask.shape
    N, d = crf.topology.num_nodes(n), crf.labels
    unary = crf.input_table(inputs, mask)
    scope = ModelScope(inputs, mask, crf.node_mask(mask), crf.arc_mask(mask), unary)
    logits = crf.unary.new_zeros(B, d)
    with pyro.plate("batch", B, dim=-1):
        for i in range(N):
            scope.z.append(pyro.sample(f"z_{i}", dist.Categorical(logits=logits), infer={"variable": "Z"}))
        for template in crf.templates():
            template.add_to_model(crf, scope)
