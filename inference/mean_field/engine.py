"""Unrolled mean-field inference on a ``graphs.CRF``: the Probabilistic Transformer.

q(Z, H, G) = prod_i q(Z_i) prod_{c,i} q(H_i^c) prod_i q(G_i). One iteration is one
weight-tied transformer layer: the head update is attention (a softmax over j of
``(q_i U)(q_j V)^T``), the label update collects the message of the head i chose and
the messages of every j that chose i (the transposed attention), plus the global
(FFN-like) message, and applies a softmax.

Every multiplier is a named scalar (``MessageWeights`` times, with ``mup=True``,
``MupScales``). With the default weights ("crf", all 1) and no μP, the updates are
the CRF's own mean-field updates: the sequential schedule is coordinate ascent and
never decreases the ELBO. ``weights="reference"`` reproduces the PT reference code
(head and topic logits times d; pt-spec.md §2.2).

Schedules:
    async       the reference order: per iteration all heads (from the current labels),
                then all labels (from the new heads).
    parallel    heads and labels both from the previous iteration (Jacobi).
    sequential  coordinate ascent, node by node: before each label update every
                head and global marginal is refreshed. Slow (O(N) kernel calls per
                iteration), naive kernel only; the ELBO after every step is in
                ``trace["elbo_steps"]``.
    macaron     Macaron ordering (needs global labels): per iteration a half-step global
                update, the head update, a second half-step global update. The global
                message to the labels is the mean of the two half-steps' messages, each
                refreshed from the labels current at its half-step.

Options (each a named constructor argument):
    halting     "act" (adaptive computation time) or "exit" (confidence-based exit at
                inference), ``inference.mean_field.halting``; frozen halted tokens, masks only.
    span        adaptive attention span: a learned span z_c per channel and the soft
                distance mask m(x) = clamp((R + z_c - x) / R, 0, 1) on token arcs at
                distance x, added as the log prior log m(x) on the head variables (a
                potential on H, so the ELBO still bounds log Z of the CRF with that prior).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from inference.mean_field import bound as mean_field_bound
from inference.mean_field import schedules as mean_field_schedules
from inference.mean_field.factor_messages import FactorTerms
from inference.mean_field.halting import checked_confidence
from inference.mean_field.kernels import choice as kernel_choice
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.head_kernels import HeadStructure
from inference.mean_field.kernels.null_softmax import softmax_with_null
from inference.mean_field.message_weights import MessageWeights, MupScales
from inference.mean_field.options import KERNELS, SCHEDULES, MeanFieldOptions, OptionView
from inference.mean_field.projections import GemmTables, at_label_rank, back_project, project
from inference.mean_field.schedules import Batch, LayerSteps
from inference.posterior import Posterior

__all__ = ["MeanField", "MeanFieldOptions", "MessageWeights", "MupScales", "SCHEDULES", "KERNELS"]


class MeanField(nn.Module):
    """Mean-field engine compiled from a CRF (it reads the CRF's potentials and topology).

    Args:
        crf: a ``graphs.CRF`` (registered as a submodule: its parameters train).
        iterations: T, the number of unrolled iterations (layers).
        schedule: "async" (reference order), "parallel" or "sequential".
        mup: multiply in ``mup_scales`` (default ``MupScales.reconstruction(crf)``).
        kernel: "naive" (materialised head marginals), "fused" (never materialised;
            no damping, step size or dropout on heads), "flex" (the same through torch's
            flex_attention: compiled and memory-linear on CUDA, eager elsewhere), or "auto"
            ("flex" on CUDA, else "fused" on the CPU from a length that depends on the
            ternary form, else "naive").
        dropout: dropout on head marginals and on label logits (reference placement).
        damping: beta in [0, 1): logits <- beta * previous + (1 - beta) * new; a float
            or a (labels, heads) pair.
        step_size: alpha in (0, 1]: marginals <- (1 - alpha) * previous + alpha * new.
        weights: "crf" (all 1), "reference" (PT code), a dict or ``MessageWeights``.
        halting: "none", "act" or "exit"; halting_source: what the ACT halting unit
            reads, "posterior" (the label marginals) or "delta" (max |q_t - q_{t-1}|);
            act_epsilon: ACT's epsilon; exit_threshold: the confidence that ends a token
            (``forward(..., confidence=fn)`` supplies the confidence of label logits).
        span: adaptive attention span with spans in [0, span_max] and ramp span_ramp.
        memory_topk: k, the product-key memory's candidates per half and values kept
            (``graphs.CRF(global_memory="product_key")``).
        initial_head_logits: what the first head update is damped against (head damping
            > 0): "none" (no damping at t = 0: the first update is taken whole) or "ones"
            (the PT reference code's cache, a tensor of ones: logits <- beta + (1 - beta) new,
            i.e. (1 - beta) new up to a constant per row).

    The parsed arguments are ``options``, a frozen ``MeanFieldOptions``: what the schedules,
    the bound and the kernel choice read (with the CRF and ``training``), never the engine.
    ``engine.kernel``, ``engine.iterations`` and the other settings read and write it.
    """

    # the constructor's settings, as attributes (read and written through ``options``)
    iterations = OptionView()
    schedule = OptionView()
    mup = OptionView()
    kernel = OptionView()
    dropout = OptionView()
    damping = OptionView()
    step_size = OptionView()
    weights = OptionView()
    mup_scales = OptionView()
    halting = OptionView()
    halting_source = OptionView()
    act_epsilon = OptionView()
    exit_threshold = OptionView()
    span_max = OptionView()
    span_ramp = OptionView()
    memory_topk = OptionView()
    initial_head_logits = OptionView()

    def __init__(
        self,
        crf,
        iterations: int = 4,
        schedule: str = "async",
        mup: bool = False,
        kernel: str = "auto",
        dropout: float = 0.0,
        damping=0.0,
        step_size=1.0,
        weights=None,
        mup_scales: MupScales | None = None,
        halting: str = "none",
        halting_source: str = "posterior",
        act_epsilon: float = 0.01,
        exit_threshold: float = 0.9,
        span: bool = False,
        span_max: int = 64,
        span_ramp: int = 8,
        memory_topk: int = 32,
        initial_head_logits: str = "none",
    ):
        super().__init__()
        if hasattr(crf, "templates"):  # refuse, by name, any factor this engine cannot compile
            from inference.declaration import compile_templates

            compile_templates(crf, "MeanField")
        self.options = MeanFieldOptions.parse(
            crf,
            iterations=iterations,
            schedule=schedule,
            mup=mup,
            kernel=kernel,
            dropout=dropout,
            damping=damping,
            step_size=step_size,
            weights=weights,
            mup_scales=mup_scales,
            halting=halting,
            halting_source=halting_source,
            act_epsilon=act_epsilon,
            exit_threshold=exit_threshold,
            span=span,
            span_max=span_max,
            span_ramp=span_ramp,
            memory_topk=memory_topk,
            initial_head_logits=initial_head_logits,
        )
        self.crf = crf
        own = {"dtype": crf.unary.dtype, "device": crf.unary.device}  # its own parameters: the CRF's dtype
        if halting == "act":  # p_t = sigmoid(w . features + b)
            self.halting_unit = nn.Linear(crf.labels if halting_source == "posterior" else 1, 1, **own)
        # the span as a fraction of span_max (Sukhbaatar et al.): it starts at 1, the span penalty shrinks it
        self.span = nn.Parameter(torch.ones(crf.channels, **own)) if span else None
        self._score_bound = kernel_choice.ScoreBound()  # the fused kernel's precision reads it
        self.fused_compute_dtype(1.0)  # the score bound, read once now: a compiled graph uses it

    def extra_repr(self) -> str:
        return f"iterations={self.iterations}, schedule={self.schedule!r}, mup={self.mup}, kernel={self.kernel!r}"

    # ---- configuration --------------------------------------------------------------

    def scales(self) -> dict[str, float]:
        """The effective multiplier of every message (weights times μP factors)."""
        return self.options.scales()

    def resolved_kernel(self, num_nodes: int, device: torch.device) -> str:
        return kernel_choice.resolved_kernel(self.options, self.crf, num_nodes, device, self.training)

    # ---- building blocks -------------------------------------------------------------

    def structure(self, tokens, mask, embeddings=None):
        """``(tokens, mask, HeadStructure)`` of a checked batch; with ``embeddings [B, n, D]``
        (a CRF with ``embedding_size``) ``tokens`` is None and the first item is the checked
        embeddings."""
        crf = self.crf
        tokens, mask = crf.check_any(tokens, mask, embeddings)  # the CRF owns what it reads
        crf.check_parameters()
        n = tokens.shape[1]
        # memory linear in n: the token table, the [B, N, N] arcs and [N, N] groups are built only if a
        # materialising kernel reads them (HeadStructure's docstring)
        structure = HeadStructure(
            n=n,
            gamma=crf.gamma,
            cuts=crf.distance_cuts,
            nodes=crf.node_mask(mask),
            border=crf.topology.border(mask),
            band=crf.topology.band,
            prior=None if self.span is None else self.span_prior(n, crf.topology.num_nodes(n)),
            topology=crf.topology,
            arcs=crf.arc_mask(mask) if crf.topology.row_tokens else None,  # token arcs of each row's length
        )
        return tokens, mask, structure

    def spans(self) -> torch.Tensor:
        """``[C]`` the spans z_c in use: span_max times the parameter clamped to [0, 1]."""
        return self.options.span_max * self.span.clamp(0, 1)

    def span_prior(self, n: int, num_nodes: int) -> torch.Tensor:
        """``[C, N, N]`` log m(|i - j|) on token arcs, 0 on arcs touching virtual nodes.
        m is floored at 1e-6 so a row never loses every head."""
        position = torch.arange(n, device=self.span.device)
        distance = (position[None, :] - position[:, None]).abs().to(self.span.dtype)
        ramp = self.options.span_ramp
        soft = ((ramp + self.spans()[:, None, None] - distance) / ramp).clamp(1e-6, 1)
        return F.pad(soft.log(), (0, num_nodes - n, 0, num_nodes - n))

    def project(self, q_z, tables: GemmTables | None = None):
        """Per-group, per-channel projections ``[B, N, K, C, r]`` of the label marginals (r: the
        rank of ``gemm_tables``, d when it is below the CRF's; K = 1:
        one serves every group, the shared form; the fused kernel's tables: tuples of the K
        groups, ``projections.project``). ``tables``: ``gemm_tables()``, once per forward."""
        return project(q_z, tables or self.gemm_tables())

    def gemm_tables(self, structure: HeadStructure | None = None, kernel: str = "naive") -> GemmTables:
        """The projection tables in the GEMMs' layouts, message weights included; for the fused
        kernel on ``structure``, only the groups it reads (a causal topology reads half), each
        projected as its own tensor (``GemmTables.as_groups``). A rank above the label count
        is computed at rank d (``at_label_rank``)."""
        u, v, _ = self.crf.projection_tables()
        if u.shape[3] > u.shape[2]:
            u, v = at_label_rank(u, v)
        groups = head_kernels.used_groups(structure) if kernel == "fused" and u.shape[0] > 1 else None
        kept = None if groups == tuple(range(u.shape[0])) else groups
        return GemmTables.of(u, v, self.scales(), kept, as_groups=kernel == "fused")

    def head_bias(self) -> torch.Tensor | None:
        """``[K, C]`` the head-logit bias of each distance group and channel (the shared
        ternary form), or None. A potential on the heads alone: added to the scaled scores,
        never multiplied by the attention weight or μP factor (``head_kernels``)."""
        return self.crf.projection_tables()[2]

    def fused_compute_dtype(self, scale: float) -> torch.dtype | None:
        """float64 where float32 would be inaccurate, else None (``kernel_choice``)."""
        return kernel_choice.fused_compute_dtype(self.crf, self._score_bound, scale)

    def heads(self, query, key, value, value_rev, structure, kernel, previous=None, tables: GemmTables | None = None):
        """The head messages through ``kernel`` (``kernel_choice.heads``); ``tables``: the
        forward's ``gemm_tables``, whose groups the projections hold and through which the
        fused kernel back-projects its messages as it writes them."""
        chosen = (self.options, self.crf, self._score_bound, query, key, value, value_rev, structure, kernel)
        groups, back = (None, None) if tables is None else (tables.groups, tables.back)
        return kernel_choice.heads(*chosen, training=self.training, previous=previous, groups=groups, back=back)

    def topic(self, q_z, mask):
        """Global-variable marginals ``[B, n, g]`` and their message to the labels ``[B, N, d]``.
        A product-key memory returns its marginals as ``(probabilities, values)``, each
        ``[B, n, k]``: the k values it kept."""
        n = mask.shape[1]
        binary, dropout = self.crf.binary, self.options.dropout
        query = self.scales()["topic_logits"] * q_z[:, :n]
        if self.crf.global_memory == "product_key":
            probs, index = self.memory_posterior(query, self.options.memory_topk)
            probs = probs * mask[..., None]
            dropped = F.dropout(probs, dropout, self.training) if dropout else probs
            message = (dropped[..., None] * binary[index]).sum(-2)
            return (probs, index), F.pad(message, (0, 0, 0, q_z.shape[1] - n))
        q_g = (query @ binary.T).softmax(-1) * mask[..., None]
        dropped = F.dropout(q_g, dropout, self.training) if dropout else q_g
        message = F.pad(dropped @ binary, (0, 0, 0, q_z.shape[1] - n))
        return q_g, message

    def memory_posterior(self, query, topk: int | None):
        """Product-key posterior: ``(probabilities, value ids)`` ``[..., k]`` over the top k of
        the k^2 pairs of each half's top k (``topk=None``: all g values, dense)."""
        first, second = self.crf.memory_scores(query)  # [..., s] each
        s = first.shape[-1]
        if topk is None:  # every pair: the dense posterior
            pair = (first[..., :, None] + second[..., None, :]).flatten(-2)
            index = torch.arange(s * s, device=query.device).expand_as(pair)
            return pair.softmax(-1), index
        first, first_index = first.topk(min(topk, s), dim=-1)
        second, second_index = second.topk(min(topk, s), dim=-1)
        pair = (first[..., :, None] + second[..., None, :]).flatten(-2)  # [..., k^2]
        pair_index = (first_index[..., :, None] * s + second_index[..., None, :]).flatten(-2)
        best, chosen = pair.topk(min(topk, pair.shape[-1]), dim=-1)
        return best.softmax(-1), pair_index.gather(-1, chosen)

    def label_logits(self, unary, messages, topic_message, tables: GemmTables | None = None):
        """Label logits from the unary potentials, the head messages (None: none yet) and
        the global message (None: no global variable). The fused kernel's own back-projection
        (``label_message``) is used only when it went through these ``tables``."""
        s = self.scales()
        logits = s["unary"] * unary
        by_kernel = messages is not None and messages.label_message is not None
        if by_kernel and tables is not None and messages.label_back is tables.back:
            logits = logits + messages.label_message
        elif messages is not None:  # both directions, every group (or the groups' sum) in one GEMM
            stacked = messages.stacked
            if stacked is None:  # the fused kernel writes them stacked; the others are stacked here
                stacked = torch.stack([messages.forward, messages.reverse], 2)
            logits = logits + back_project(stacked, tables or self.gemm_tables())
        if topic_message is not None:
            logits = logits + s["topic"] * topic_message
        return logits

    # ---- the bound ---------------------------------------------------------------------

    def elbo(self, logits, unary, mask, structure, kernel="naive", terms: FactorTerms | None = None):
        """``[B]`` ELBO of q_z = softmax(logits), heads and globals at their optimum given
        q_z: always <= log Z (``mean_field_bound.elbo``)."""
        return mean_field_bound.elbo(self.crf, self._steps(), logits, unary, mask, structure, kernel, terms)

    def full_elbo(self, q_z, q_h, q_g, unary, mask, structure, terms: FactorTerms | None = None):
        """``[B]`` ELBO of explicit marginals (``mean_field_bound.full_elbo``)."""
        return mean_field_bound.full_elbo(self.crf, self._steps(), q_z, q_h, q_g, unary, mask, structure, terms)

    # ---- forward ----------------------------------------------------------------------

    def forward(self, tokens=None, mask=None, confidence=None, embeddings=None) -> Posterior:
        """``confidence``: label logits ``[B, N, d]`` -> ``[B, N]``, the confidence that
        ends a token under ``halting="exit"``: needed at inference (in training every
        iteration runs and it is ignored); ``confidence=False`` runs every iteration.
        ``embeddings [B, n, D]`` instead of ``tokens``: a CRF with ``embedding_size=D``,
        whose unary potentials are ``embeddings @ crf.unary``."""
        confidence = checked_confidence(self.options.halting, self.training, confidence)
        tokens, mask, structure = self.structure(tokens, mask, embeddings)
        kernel = self.resolved_kernel(structure.nodes.shape[1], tokens.device)
        factors = getattr(self.crf, "factors", ())
        unary = self.crf.input_table(tokens, mask)  # tokens: the checked token ids or embeddings
        terms = FactorTerms(factors, tokens, mask, structure.nodes.shape[1]) if len(factors) else None
        if self.options.schedule == "sequential":
            logits, last, history, extra = self._sequential(unary, mask, structure, kernel, terms)
        else:
            logits, last, history, extra = self._unrolled(unary, mask, structure, kernel, confidence, terms=terms)
        logits = logits * structure.nodes[..., None]
        q_z = logits.softmax(-1) * structure.nodes[..., None]
        q_g = self.topic(q_z, mask)[0] if self.crf.global_labels else None

        def head_marginals(messages=last):
            if messages.probs is not None:
                return messages.probs
            scale = self.scales()["attention"]
            bias = self.head_bias()
            query, key = (torch.stack(t, 2) if isinstance(t, tuple) else t for t in (messages.query, messages.key))
            logits_h = head_kernels.naive_logits(query, key, scale, structure, bias, messages.groups)
            return softmax_with_null(logits_h, structure.has_head)[0]

        def trace():
            heads = torch.stack([head_marginals(m) for m in extra["heads"]])
            found = {**extra, "logits": torch.stack(history), "heads": heads}
            if self.crf.global_memory == "dense":  # a product-key memory has no ELBO
                found["elbo"] = torch.stack([self.elbo(x, unary, mask, structure, kernel, terms) for x in history])
            return found

        return Posterior(
            z=q_z,
            h=head_marginals,
            g=q_g,
            elbo=lambda: self.elbo(logits, unary, mask, structure, kernel, terms),
            logits=logits,
            trace=trace,
            history=history,
            halting=extra.get("halting"),
        )

    def _unrolled(self, unary, mask, structure, kernel, confidence=None, initial=None, frozen=None, terms=None):
        """async, parallel and macaron schedules (``mean_field_schedules.unrolled``)."""
        tables = self.gemm_tables(structure, kernel)  # once: every iteration's GEMMs read the same tables
        batch = Batch(unary, mask, structure, kernel, tables, terms, frozen)
        steps = self._steps()
        return mean_field_schedules.unrolled(
            self.options, self.crf, steps, batch, training=self.training, confidence=confidence, initial=initial
        )

    def _sequential(self, unary, mask, structure, kernel, terms=None):
        """Coordinate ascent (``mean_field_bound.sequential``)."""
        return mean_field_bound.sequential(self.options, self.crf, self._steps(), unary, mask, structure, terms)

    def _steps(self) -> LayerSteps:
        """This engine's operations of one layer, as the schedules and the bound call them."""
        return LayerSteps(
            project=self.project,
            heads=self.heads,
            topic=self.topic,
            label_logits=self.label_logits,
            log_normaliser=functools.partial(kernel_choice.log_normaliser, self.crf, self._score_bound),
            halting_unit=getattr(self, "halting_unit", None),
        )
