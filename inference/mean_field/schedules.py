"""The unrolled schedules of ``inference.MeanField`` (async, parallel, macaron): the
transformer-like computation, one iteration per layer. They read the engine's options
(``MeanFieldOptions``), its CRF and the operations of one layer (``LayerSteps``: the
projections, head kernels, global update and label update), never the engine itself.
The sequential schedule (coordinate ascent) is ``bound.sequential``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from inference.mean_field.halting import ACT, ConfidenceExit
from inference.mean_field.kernels.structure import each_group

__all__ = ["LayerSteps", "Batch", "unrolled", "heads_then_labels", "macaron"]


class LayerSteps(NamedTuple):
    """The operations of one mean-field layer, bound to an engine (each documented on
    ``MeanField``): what the schedules and the bound call."""

    project: Callable  # (q_z, tables=None) -> (query, key)
    heads: Callable  # (query, key, value, value_rev, structure, kernel, previous=None, tables=None) -> HeadMessages
    topic: Callable  # (q_z, mask) -> (global marginals, their message to the labels)
    label_logits: Callable  # (unary, messages, topic_message, tables=None) -> label logits
    log_normaliser: Callable  # (query, key, structure, kernel) -> [B, C, N] head-row log-normalisers
    halting_unit: Callable | None  # ACT's halting unit (features -> logit), None without ACT


class Batch(NamedTuple):
    """What every iteration on one batch reads: the unary potentials ``[B, N, d]``, the token
    mask, the ``HeadStructure``, the kernel's name, the projection tables (``GemmTables``),
    the extra templates' messages (``FactorTerms`` or None) and the frozen nodes (or None)."""

    unary: torch.Tensor
    mask: torch.Tensor
    structure: Any
    kernel: str
    tables: Any
    terms: Any = None
    frozen: torch.Tensor | None = None


def unrolled(
    options, crf, steps: LayerSteps, batch: Batch, *, training: bool, confidence=None, initial=None
) -> tuple[torch.Tensor, Any, list, dict]:
    """async, parallel and macaron schedules: the transformer-like computation.
    ``initial``: starting label logits (default the unary); ``batch.frozen [B, N]``: nodes
    whose logits never change (``inference.Folded``'s condensed memory); ``batch.terms``: the
    extra templates' messages (``FactorTerms``), from the same labels as the heads.
    Returns the label logits, the last head messages, every iteration's logits and the
    trace's extras."""
    _check_factor_messages(crf, batch.terms)
    nodes = batch.structure.nodes
    beta_z, alpha_z = options.damping[0], options.step_size[0]
    act, exit_ = _halting_trackers(options, nodes, batch.unary.dtype, training, confidence)
    logits, used_q, heads = (batch.unary if initial is None else initial), None, None
    carried = None  # parallel: the last iteration's projections and labels; macaron: its late global message
    history, deltas, all_heads = [], [], []
    for t in range(options.iterations):
        previous = logits
        q_z, used_q = _label_marginals(logits, used_q, alpha_z, nodes)
        if options.schedule == "macaron":
            new, heads, carried = macaron(steps, batch, q_z, heads, carried)
        else:
            schedule, global_labels = options.schedule, crf.global_labels
            new, heads, carried = heads_then_labels(schedule, global_labels, steps, batch, q_z, heads, carried)
        logits = beta_z * logits + (1 - beta_z) * new if beta_z else new
        if options.dropout:
            logits = F.dropout(logits, options.dropout, training)
        logits = _hold_halted(logits, previous, act, exit_, batch.frozen)
        change = (logits.softmax(-1) - used_q).abs().amax(-1)  # [B, N]
        last = t == options.iterations - 1
        _step_halting(options, steps.halting_unit, act, exit_, logits, change, confidence, last)
        deltas.append((change * nodes).amax(-1))
        history.append(logits)
        all_heads.append(heads)
    extra = {"max_delta": torch.stack(deltas).detach(), "heads": all_heads}
    if act is not None:
        logits, extra["halting"] = act.output, act.summary()
    elif exit_ is not None:
        extra["halting"] = exit_.summary()
    return logits, heads, history, extra


def heads_then_labels(schedule: str, global_labels: int, steps: LayerSteps, batch: Batch, q_z, heads, lagged):
    """One async or parallel iteration from the label marginals ``q_z``: the head and global
    updates, then the label logits. async reads the current labels; parallel (Jacobi) reads
    ``lagged``, the last iteration's projections and labels, and returns this one's.
    Returns ``(new label logits, head messages, lagged)``."""
    query, key = steps.project(q_z, batch.tables)
    if schedule == "async":
        source = (query, key, q_z)
    else:  # zero projections and labels give uniform heads and globals at t = 0
        source = lagged or (
            each_group(torch.zeros_like, query),
            each_group(torch.zeros_like, key),
            torch.zeros_like(q_z),
        )
        lagged = (query, key, q_z)
    heads = steps.heads(source[0], source[1], key, query, batch.structure, batch.kernel, heads, batch.tables)
    topic_message = steps.topic(source[2], batch.mask)[1] if global_labels else None
    new = steps.label_logits(batch.unary, heads, topic_message, batch.tables)
    if batch.terms is not None:
        new = new + batch.terms.message(source[2])
    return new, heads, lagged


def macaron(steps: LayerSteps, batch: Batch, q_z, heads, topic_late):
    """One Macaron iteration: half-step global, head update, half-step global
    (frozen nodes keep ``q_z`` through the half-steps). The extra templates' messages
    come from the labels at the start of the iteration. Returns ``(new label logits,
    head messages, the late half-step's global message)``."""
    nodes = batch.structure.nodes[..., None]
    start, frozen, terms = q_z, batch.frozen, batch.terms
    factor_message = terms.message(start) if terms is not None else 0.0

    def half_step(messages, topic_message):
        logits = steps.label_logits(batch.unary, messages, topic_message, batch.tables) + factor_message
        updated = logits.softmax(-1) * nodes
        return updated if frozen is None else torch.where(frozen[..., None], start, updated)

    topic_early = steps.topic(q_z, batch.mask)[1]
    late = torch.zeros_like(topic_early) if topic_late is None else topic_late
    q_z = half_step(heads, 0.5 * (topic_early + late))
    query, key = steps.project(q_z, batch.tables)
    heads = steps.heads(query, key, key, query, batch.structure, batch.kernel, heads, batch.tables)
    q_z = half_step(heads, 0.5 * (topic_early + late))
    topic_late = steps.topic(q_z, batch.mask)[1]
    new = steps.label_logits(batch.unary, heads, 0.5 * (topic_early + topic_late), batch.tables) + factor_message
    return new, heads, topic_late


def _check_factor_messages(crf, terms) -> None:
    """Refuse a CRF with extra factors when no messages for them were given."""
    if terms is None and len(getattr(crf, "factors", ())):
        raise ValueError(
            f"this unrolled mean field got no messages for the CRF's extra factors "
            f"{[f.name for f in crf.factors]} (segment-by-segment inference.Folded does not compile "
            f"them); engines that can: MeanField, Exact, Gibbs"
        )


def _label_marginals(logits, used_q, alpha_z: float, nodes):
    """``(q_z on the nodes, q_z as used)``: softmax of ``logits``, moved by the label step
    size from the marginals the last iteration used."""
    q_z = logits.softmax(-1)
    if used_q is not None and alpha_z != 1.0:
        q_z = (1 - alpha_z) * used_q + alpha_z * q_z
    return q_z * nodes[..., None], q_z


def _halting_trackers(options, nodes, dtype, training: bool, confidence):
    """``(ACT or None, ConfidenceExit or None)``: exit runs at inference, given a confidence."""
    act = ACT(nodes, options.act_epsilon, dtype) if options.halting == "act" else None
    use_exit = options.halting == "exit" and not training and confidence is not None
    return act, ConfidenceExit(nodes, options.exit_threshold, dtype) if use_exit else None


def _hold_halted(logits, previous, act, exit_, frozen):
    """Halted (and frozen) nodes keep their ``previous`` logits."""
    running = act.running if act is not None else exit_.running if exit_ is not None else None
    if frozen is not None:
        running = ~frozen if running is None else running & ~frozen
    if running is not None:
        logits = torch.where(running[..., None], logits, previous)
    return logits


def _step_halting(options, halting_unit, act, exit_, logits, change, confidence, last: bool) -> None:
    """Account for one iteration in the halting trackers: ACT's unit reads the label
    marginals or their change; exit reads the confidence of the logits."""
    if act is not None:
        features = logits.softmax(-1) if options.halting_source == "posterior" else change[..., None]
        act.step(logits, torch.sigmoid(halting_unit(features)).squeeze(-1), last)
    if exit_ is not None:
        exit_.step(confidence(logits))
