"""The unrolled schedules of ``inference.MeanField`` (async, parallel, macaron): the
transformer-like computation, one iteration per layer, as functions of the engine (its
projections, head kernels and label updates). The sequential schedule (coordinate ascent)
is ``mean_field_bound.sequential``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.mean_field.halting import ACT, ConfidenceExit

__all__ = ["unrolled", "macaron"]


def unrolled(engine, unary, mask, structure, kernel, confidence=None, initial=None, frozen=None, terms=None):
    """async, parallel and macaron schedules: the transformer-like computation.
    ``initial``: starting label logits (default the unary); ``frozen [B, N]``: nodes
    whose logits never change (``inference.Folded``'s condensed memory); ``terms``: the
    extra templates' messages (``FactorTerms``), from the same labels as the heads."""
    if terms is None and len(getattr(engine.crf, "factors", ())):
        raise ValueError(
            f"this unrolled mean field got no messages for the CRF's extra factors "
            f"{[f.name for f in engine.crf.factors]} (segment-by-segment inference.Folded does not compile "
            f"them); engines that can: MeanField, Exact, Gibbs"
        )
    beta_z, _ = engine.damping
    alpha_z, _ = engine.step_size
    nodes = structure.nodes[..., None]
    logits, used_q, heads = (unary if initial is None else initial), None, None
    lagged = None  # parallel: projections (and labels) of the previous iteration
    topic_late = None  # macaron: the second half-step's global message
    history, deltas, all_heads = [], [], []
    tables = engine.gemm_tables(structure, kernel)  # once: every iteration's GEMMs read the same tables
    act = ACT(structure.nodes, engine.act_epsilon, unary.dtype) if engine.halting == "act" else None
    use_exit = engine.halting == "exit" and not engine.training and confidence is not None
    exit_ = ConfidenceExit(structure.nodes, engine.exit_threshold, unary.dtype) if use_exit else None
    for t in range(engine.iterations):
        previous = logits
        q_z = logits.softmax(-1)
        if used_q is not None and alpha_z != 1.0:
            q_z = (1 - alpha_z) * used_q + alpha_z * q_z
        used_q = q_z
        q_z = q_z * nodes
        if engine.schedule == "macaron":
            new, heads, topic_late = macaron(
                engine, tables, unary, q_z, mask, structure, kernel, heads, topic_late, frozen, terms
            )
        else:
            query, key = engine.project(q_z, tables)
            if engine.schedule == "async":
                source = (query, key, q_z)
            else:  # zero projections and labels give uniform heads and globals at t = 0
                source = lagged or (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(q_z))
                lagged = (query, key, q_z)
            heads = engine.heads(source[0], source[1], key, query, structure, kernel, heads, tables.groups)
            topic_message = engine.topic(source[2], mask)[1] if engine.crf.global_labels else None
            new = engine.label_logits(unary, heads, topic_message, tables)
            if terms is not None:
                new = new + terms.message(source[2])
        logits = beta_z * logits + (1 - beta_z) * new if beta_z else new
        if engine.dropout:
            logits = F.dropout(logits, engine.dropout, engine.training)
        running = act.running if act else exit_.running if exit_ else None
        if frozen is not None:
            running = ~frozen if running is None else running & ~frozen
        if running is not None:  # halted (and frozen) nodes keep their logits
            logits = torch.where(running[..., None], logits, previous)
        change = (logits.softmax(-1) - used_q).abs().amax(-1)  # [B, N]
        if act is not None:
            features = logits.softmax(-1) if engine.halting_source == "posterior" else change[..., None]
            act.step(logits, torch.sigmoid(engine.halting_unit(features)).squeeze(-1), t == engine.iterations - 1)
        if exit_ is not None:
            exit_.step(confidence(logits))
        deltas.append((change * structure.nodes).amax(-1))
        history.append(logits)
        all_heads.append(heads)
    extra = {"max_delta": torch.stack(deltas).detach(), "heads": all_heads}
    if act is not None:
        logits, extra["halting"] = act.output, act.summary()
    elif exit_ is not None:
        extra["halting"] = exit_.summary()
    return logits, heads, history, extra


def macaron(engine, tables, unary, q_z, mask, structure, kernel, heads, topic_late, frozen=None, terms=None):
    """One Macaron iteration: half-step global, head update, half-step global
    (frozen nodes keep ``q_z`` through the half-steps). The extra templates' messages
    come from the labels at the start of the iteration."""
    nodes = structure.nodes[..., None]
    start = q_z
    factor_message = terms.message(start) if terms is not None else 0.0

    def half_step(messages, topic_message):
        updated = (engine.label_logits(unary, messages, topic_message, tables) + factor_message).softmax(-1) * nodes
        return updated if frozen is None else torch.where(frozen[..., None], start, updated)

    topic_early = engine.topic(q_z, mask)[1]
    late = torch.zeros_like(topic_early) if topic_late is None else topic_late
    q_z = half_step(heads, 0.5 * (topic_early + late))
    query, key = engine.project(q_z, tables)
    heads = engine.heads(query, key, key, query, structure, kernel, heads, tables.groups)
    q_z = half_step(heads, 0.5 * (topic_early + late))
    topic_late = engine.topic(q_z, mask)[1]
    new = engine.label_logits(unary, heads, 0.5 * (topic_early + topic_late), tables) + factor_message
    return new, heads, topic_late
