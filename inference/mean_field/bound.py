"""The mean-field bound and coordinate ascent on it, for ``inference.MeanField``.

``elbo``: the ELBO of label marginals with the head and global marginals at their optimum
(the row log-normalisers of the head kernels); ``full_elbo``: the ELBO of explicit marginals;
``sequential``: the sequential schedule, coordinate ascent node by node, which never
decreases ``full_elbo``. Each takes the CRF and the operations of a layer
(``schedules.LayerSteps``: projections, head kernels, global and label updates); the
sequential schedule also the engine's options (``MeanFieldOptions``).
"""

from __future__ import annotations

import torch

from inference.mean_field.factor_messages import FactorTerms
from inference.mean_field.kernels import head_kernels
from inference.mean_field.schedules import LayerSteps

__all__ = ["elbo", "full_elbo", "sequential"]


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Elementwise -p log p with a finite gradient at p = 0 (xlogy's is not)."""
    return -p * torch.where(p > 0, p, 1.0).log()


def elbo(crf, steps: LayerSteps, logits, unary, mask, structure, kernel="naive", terms: FactorTerms | None = None):
    """``[B]`` ELBO of q_z = softmax(logits) with the head and global marginals at their
    optimum given q_z, under the CRF's own potentials (any weights or μP): a member
    of the mean-field family, so always <= log Z. (None of this holds for a product-key
    memory, which is not a CRF factor: ``ValueError``.) ``terms``: the CRF's extra templates
    on this batch (their expected log-potentials)."""
    crf.check_factor_graph()
    nodes = structure.nodes[..., None]
    log_q = logits.log_softmax(-1)
    q_z = log_q.exp() * nodes
    query, key = steps.project(q_z)
    lse = steps.log_normaliser(query, key, structure, kernel)  # [B, C, N]
    entropy = -(q_z * log_q).sum((1, 2))  # log_softmax keeps the gradient finite at q = 0
    value = (q_z * unary).sum((1, 2)) + entropy + lse.sum((1, 2))
    if crf.global_labels:
        n = mask.shape[1]
        value = value + ((q_z[:, :n] @ crf.binary.T).logsumexp(-1) * mask).sum(-1)
    if terms is not None:
        value = value + terms.expected(q_z)
    return value


def full_elbo(crf, steps: LayerSteps, q_z, q_h, q_g, unary, mask, structure, terms: FactorTerms | None = None):
    """``[B]`` ELBO of explicit marginals (q_h materialised): expected log-potential
    plus entropies."""
    query, key = steps.project(q_z)
    potentials = head_kernels.naive_logits(query, key, 1.0, structure, crf.projection_tables()[2])
    expected = torch.where(structure.arcs[:, None], potentials, 0.0)
    value = (q_z * unary).sum((1, 2)) + (q_h * expected).sum((1, 2, 3))
    value = value + _entropy(q_z).sum((1, 2)) + _entropy(q_h).sum((1, 2, 3))
    if q_g is not None:
        n = mask.shape[1]
        value = value + (q_g * (q_z[:, :n] @ crf.binary.T)).sum((1, 2))
        value = value + _entropy(q_g).sum((1, 2))
    if terms is not None:
        value = value + terms.expected(q_z)
    return value


def sequential(options, crf, steps: LayerSteps, unary, mask, structure, terms=None):
    """Coordinate ascent: refresh every head and global marginal, then one node's labels."""
    nodes = structure.nodes
    logits = unary.clone()
    q_z = logits.softmax(-1) * nodes[..., None]
    history, elbo_steps, deltas, all_heads = [], [], [], []
    heads = None
    for _ in range(options.iterations):
        start = q_z
        for i in range(nodes.shape[1]):
            if not nodes[:, i].any():
                continue
            query, key = steps.project(q_z)
            heads = steps.heads(query, key, key, query, structure, "naive")
            q_g, topic_message = steps.topic(q_z, mask) if crf.global_labels else (None, None)
            elbo_steps.append(full_elbo(crf, steps, q_z, heads.probs, q_g, unary, mask, structure, terms))
            row = steps.label_logits(unary, heads, topic_message)[:, i]
            if terms is not None:
                row = row + terms.message(q_z)[:, i]
            logits = logits.clone()
            logits[:, i] = torch.where(nodes[:, i, None], row, logits[:, i])
            q_z = logits.softmax(-1) * nodes[..., None]
            elbo_steps.append(full_elbo(crf, steps, q_z, heads.probs, q_g, unary, mask, structure, terms))
        history.append(logits)
        deltas.append((q_z - start).abs().amax((1, 2)))
        all_heads.append(heads)
    extra = {
        "elbo_steps": torch.stack(elbo_steps).detach(),
        "max_delta": torch.stack(deltas).detach(),
        "heads": all_heads,
    }
    return logits, heads, history, extra
