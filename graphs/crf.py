"""The CRF of the Probabilistic Transformer, declared as data and as a Pyro model.

Per node i (tokens first, then the topology's virtual nodes) a label
``Z_i in {0..d-1}``; per channel c and node i a head ``H_i^c`` among the nodes the
topology allows; optionally per token a global ("topic") variable ``G_i in {0..g-1}``.

    unary    log phi(Z_i = a)                    = unary[w_i, a]       (0 for virtual nodes)
    ternary  log phi(H_i^c = j, Z_i = a, Z_j = b) = T[k(i, j), c, a, b]
    binary   log phi(Z_i = a, G_i = m)            = binary[m, a]

with ``T[k, c] = ternary_u[k, c] @ ternary_v[k, c].T`` (rank r) and ``k(i, j)`` the
distance group of the arc: direction x clipped distance, ``2 * (gamma + 1)``
groups over token pairs (``gamma = 3`` gives 8), plus one more group for arcs that
touch a virtual node when the topology has any.

Group order for token arcs (dependent i, head j, offset delta = j - i):
    head to the right (delta > 0): group min(delta, gamma + 1) - 1         -> 0 .. gamma
    head to the left  (delta < 0): group gamma + min(-delta, gamma + 1)    -> gamma + 1 .. 2 gamma + 1

Parameter layout (what engines and users read):
    unary      [V, d]
    ternary_u  [K, C, d, r]   dependent side
    ternary_v  [K, C, d, r]   head side
    binary     [g, d]         only when global_labels > 0

The ternary tensor ``T[k] : [C, d, d]`` (channel x dependent label x head label) can
be stored in four forms (``ternary_form``: "low_rank", "cp", "tucker", "shared"; the maths
of each in ``graphs.ternary``); engines read the per-channel factors ``ternary_u`` /
``ternary_v`` ``[K, C, d, r_eff]``, which every form computes (``ternary_factors``), and
``MeanField`` the cheaper ``projection_tables`` (the shared form projects once for all groups).

The global variable can be a **product-key memory** (``global_memory="product_key"``,
Lample et al. 2019) with g = s^2 values m = (m1, m2): value m scores
``q[:d/2] . memory_keys_first[m1] + q[d/2:] . memory_keys_second[m2]`` and carries the
message ``binary[m]`` (its value vector). Engines take the posterior over the top k of
the k^2 best pairs (``MeanField(memory_topk=k)``): the dense top k, renormalised, so
exactly the dense softmax over all g values only when k >= g = s^2 (k = s keeps s of
the s^2 values). Keys score and values message, so this global variable is a
memory layer at the global factor's place, not a CRF factor (no ELBO).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from graphs import crf_checks, ternary
from graphs import topology as topologies
from graphs.crf_model import ModelScope, write_model
from graphs.device_checks import refuse_unless
from graphs.distances import distance_cuts, distance_groups
from graphs.factors import Global, Ternary, Unary, check_templates
from graphs.inputs import check_assignment, check_embeddings, check_tokens
from graphs.limits import LIMITS, MAX_EMBEDDING_SIZE, MAX_PARAMETERS, check_parameter_count, check_size
from graphs.ternary import TERNARY_FORMS

# distance_cuts, distance_groups (graphs.distances), LIMITS, MAX_PARAMETERS (graphs.limits) and
# ModelScope (graphs.crf_model) are named here too: callers read them as graphs.crf.*
__all__ = [
    "CRF",
    "distance_cuts",
    "distance_groups",
    "TERNARY_FORMS",
    "GLOBAL_MEMORIES",
    "LIMITS",
    "MAX_PARAMETERS",
    "ModelScope",
]

GLOBAL_MEMORIES = ("dense", "product_key")


class CRF(nn.Module):
    """Potentials of the PT CRF on a topology. See the module docstring for the maths.

    Args:
        vocab_size: V, the number of word types.
        labels: d, the number of values of each label Z_i.
        channels: C, the number of head variables per node.
        rank: r, the rank of each ternary table T[k, c] (default: d, i.e. full rank).
        global_labels: g, values of the per-token global variable (0: none).
        topology: a ``graphs.topology.Topology``, its text form (default ``full()``), a
            ``networkx.DiGraph`` on positions, a bool ``[n_max, n_max]`` mask, a function
            n -> graph or mask, or ``Topology.to_data()``'s dict (``graphs.topology.parse``).
        gamma: distance clip; token arcs fall into ``2 * (gamma + 1)`` groups. Or a list of
            distance buckets' cut points (the PT reference's ``dists``): ``[2, 4]`` buckets
            distances as {1}, {2, 3}, [4, inf) per direction (``gamma = 3`` is ``[2, 3, 4]``);
            ``crf.gamma`` is then the number of cuts and ``crf.distance_cuts`` the cuts.
        ternary_form: "low_rank" (per-group, per-channel U V^T), "cp", "tucker" or "shared"
            (one U V^T per channel plus a bias per group; ``graphs.ternary``);
            ``ternary_blocks``: the number of Tucker blocks.
        global_memory: "dense" (the binary factor) or "product_key" (global_labels must
            be a square, s^2).
        factors: extra factor templates (``graphs.factors.Pairwise``, ``graphs.Factor``
            subclasses), added to the built-in Unary, Global and Ternary.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        labels: int | None = None,
        channels: int = 1,
        rank: int | None = None,
        global_labels: int = 0,
        topology=None,
        gamma: int = 3,
        ternary_form: str = "low_rank",
        ternary_blocks: int = 1,
        global_memory: str = "dense",
        factors: list | tuple = (),
        embedding_size: int | None = None,
    ):
        super().__init__()
        rows, rank = _check_sizes(vocab_size, embedding_size, labels, channels, rank, global_labels)
        self.distance_cuts = distance_cuts(gamma)
        gamma = len(self.distance_cuts)  # buckets per direction, minus one
        check_size("ternary_blocks", ternary_blocks, minimum=1)
        check_parameter_count(rows, labels, channels, rank, global_labels, gamma, ternary_blocks)
        ternary.check_form(ternary_form)
        _check_global_memory(global_memory, global_labels, labels)
        self.ternary_form, self.ternary_blocks = ternary_form, ternary_blocks
        self.global_memory = global_memory
        self.vocab_size, self.labels, self.channels, self.rank = vocab_size, labels, channels, rank
        self.embedding_size = embedding_size
        self.global_labels, self.gamma = global_labels, gamma
        self.topology = topologies.parse(topology if topology is not None else "full")
        self.num_groups = 2 * (gamma + 1) + (1 if self.topology.extra_nodes else 0)
        self._create_parameters(rows)
        self.factors = nn.ModuleList(check_templates(self, factors))

    def _create_parameters(self, rows: int) -> None:
        """Initialisation as the reference PT (pt-spec.md §2.3): xavier-uniform unary,
        N(0, 1/r) low-rank factors, N(0, 1/d) binary."""
        labels, global_labels = self.labels, self.global_labels
        self.unary = nn.Parameter(nn.init.xavier_uniform_(torch.empty(rows, labels)))  # [V, d] or [D, d]
        ternary.create(self, self.ternary_form, self.num_groups, self.channels, labels, self.rank, self.ternary_blocks)
        if global_labels:
            self.binary = nn.Parameter(torch.randn(global_labels, labels) * labels**-0.5)
        else:
            self.register_parameter("binary", None)
        if self.global_memory == "product_key":
            sub_keys, half = math.isqrt(global_labels), labels // 2
            self.memory_keys_first = nn.Parameter(torch.randn(sub_keys, half) * half**-0.5)
            self.memory_keys_second = nn.Parameter(torch.randn(sub_keys, labels - half) * (labels - half) ** -0.5)

    def extra_repr(self) -> str:
        form = "" if self.ternary_form == "low_rank" else f", ternary_form={self.ternary_form!r}"
        source = (
            f"vocab_size={self.vocab_size}" if self.embedding_size is None else f"embedding_size={self.embedding_size}"
        )
        return (
            f"{source}, labels={self.labels}, channels={self.channels}, "
            f"rank={self.rank}, global_labels={self.global_labels}, gamma={self.gamma}, "
            f"topology={self.topology.name}{form}"
        )

    def __getattr__(self, name: str):
        # the per-channel factors that every form but "low_rank" computes
        if name in ("ternary_u", "ternary_v") and self.__dict__.get("ternary_form", "low_rank") != "low_rank":
            return self.ternary_factors()[name == "ternary_v"]
        return super().__getattr__(name)

    def ternary_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ternary_u, ternary_v)``, each ``[K, C, d, r_eff]``, for any form."""
        return ternary.factors(self)

    def projection_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(u, v, bias)``: projection tables ``[K or 1, C, d, r]`` (1: shared by every group)
        and the head-logit bias ``[K, C]`` or None (``graphs.ternary.projection_tables``)."""
        return ternary.projection_tables(self)

    def memory_scores(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Product-key sub-scores ``([..., s], [..., s])`` of label-space queries ``[..., d]``."""
        query, half = crf_checks.product_key_query(self, query), self.labels // 2
        return query[..., :half] @ self.memory_keys_first.T, query[..., half:] @ self.memory_keys_second.T

    def ternary_parameter_count(self) -> int:
        return ternary.parameter_count(self)

    # ---- the structure as data -------------------------------------------------

    def ternary_tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[K, C, d, d]``: ``T[k, c, a, b]`` for dependent label a and head label b, summed in
        ``dtype`` (default the CRF's; a wider one keeps a half-precision CRF's products unrounded)."""
        (u, v), dtype = self.ternary_factors(), ternary.summing_dtype(dtype)
        return torch.einsum("kcar,kcbr->kcab", u.to(dtype or u.dtype), v.to(dtype or v.dtype))

    def distance_groups(self, n: int, device=None) -> torch.Tensor:
        return distance_groups(n, self.gamma, self.topology.extra_nodes, device, self.distance_cuts)

    def ternary_table(self, n: int) -> torch.Tensor:
        """``[C, N, N, d, d]`` log-potentials, N = n + virtual nodes: entry ``[c, i, j, a, b]``
        is log phi(H_i^c = j, Z_i = a, Z_j = b); ``-inf`` where the topology forbids the arc
        (always on the diagonal)."""
        self.check_parameters()
        table = self.ternary_tensor()[self.distance_groups(n)]  # [N, N, C, d, d]
        table = table.permute(2, 0, 1, 3, 4)
        allowed = self.topology.mask(n).to(table.device)[None, :, :, None, None]
        return table.masked_fill(~allowed, -math.inf)

    def node_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, N]``: real tokens, then the virtual nodes (present in every row)."""
        virtual = crf_checks.checked_mask(mask).new_ones(mask.shape[0], self.topology.extra_nodes)
        return torch.cat([mask, virtual], dim=1)

    def arc_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, N, N]``: the topology's arcs between nodes that exist in each row."""
        return self.topology.arcs(mask)  # each row's arcs for its real length: padding changes nothing

    def unary_table(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, N, d]`` unary log-potentials; 0 for padding and virtual nodes."""
        tokens, mask = crf_checks.table_tokens(self, tokens, mask)
        scores = self.unary[tokens] * mask[..., None]
        virtual = scores.new_zeros(tokens.shape[0], self.topology.extra_nodes, self.labels)
        return torch.cat([scores, virtual], dim=1)

    def embedding_table(self, embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, N, d]`` unary log-potentials ``x @ unary`` of embeddings ``x [B, n, D]``
        (``embedding_size=D``); 0 for padding and virtual nodes. One-hot embeddings give
        exactly the rows a token-id CRF with the same table reads."""
        embeddings, mask = crf_checks.table_embeddings(self, embeddings, mask)
        scores = (embeddings @ self.unary) * mask[..., None]
        virtual = scores.new_zeros(embeddings.shape[0], self.topology.extra_nodes, self.labels)
        return torch.cat([scores, virtual], dim=1)

    # ---- validation --------------------------------------------------------------

    def check_any(self, tokens=None, mask=None, embeddings=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, mask)``: token ids checked by ``check_inputs``, or (``embeddings=``, for a
        CRF with ``embedding_size``) embeddings checked by ``check_embeddings``."""
        if embeddings is None:
            return self.check_inputs(tokens, mask)
        if tokens is not None:
            raise ValueError("give tokens or embeddings, not both")
        return self.check_embeddings(embeddings, mask)

    def input_table(self, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, N, d]`` unary log-potentials of checked inputs (``unary_table`` or ``embedding_table``)."""
        return self.unary_table(inputs, mask) if self.embedding_size is None else self.embedding_table(inputs, mask)

    def check_embeddings(self, embeddings, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate embeddings ``[B, n, D]`` (floating, finite at real tokens once in the CRF's
        dtype) and their mask; returns ``(x, mask)`` with x in the CRF's dtype, which every
        engine's Posterior keeps (``graphs.inputs.check_embeddings``)."""
        crf_checks.check_reads(self, "embeddings")
        return check_embeddings(embeddings, mask, self.embedding_size, dtype=self.unary.dtype, device=self.unary.device)

    def check_inputs(self, tokens, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a batch; returns ``(tokens [B, n] long, mask [B, n] bool)``
        (``graphs.inputs.check_tokens``)."""
        crf_checks.check_reads(self, "token ids")
        return check_tokens(tokens, mask, self.vocab_size, self.unary.device)

    def check_factor_graph(self) -> None:
        """Raise unless this CRF is a factor graph whose potential engines can score (a
        product-key memory is not: its keys score and its values message)."""
        if self.global_memory != "dense":
            raise ValueError(
                "a product-key memory is not a CRF factor (keys score, values message): the potential and "
                "the Pyro model exist for global_memory='dense' only"
            )

    def check_parameters(self) -> None:
        """Raise if a parameter is NaN or Inf or ternary potentials overflow the CRF's dtype (poison to engines)."""
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return
        named = list(self.named_parameters())  # never empty: every CRF has its unary table
        # a bound, not T itself: T is [K, C, d, d], too large to build at every forward
        bound, largest = ternary.potential_bound(self), torch.finfo(self.unary.dtype).max

        def naming_the_first():
            name = next((name for name, param in named if not torch.isfinite(param).all()), None)
            k, c = divmod(int(bound.flatten().argmax()), bound.shape[1])
            return (
                f"CRF parameter {name!r} contains NaN or Inf; potentials must be finite"
                if name is not None
                else f"the ternary potentials of group {k}, channel {c} may reach {float(bound[k, c]):g} (sum_r "
                f"max|u| max|v|, a bound), beyond {self.unary.dtype}'s largest {largest:g}: they may overflow; "
                "scale the ternary parameters down (potentials must be finite)"
            )

        own = ternary.PARAMETERS[self.ternary_form]  # NaN or Inf in these makes the bound NaN or Inf
        finite = [param.isfinite().all() for name, param in named if name not in own]
        finite = torch.stack([*finite, (bound <= largest).all()]).all()
        message = "a CRF parameter contains NaN or Inf, or the ternary potentials overflow; potentials must be finite"
        refuse_unless(finite, message, naming_the_first)

    # ---- scoring and the Pyro model ------------------------------------------------

    def log_potential(self, tokens, z, h, g=None, mask=None) -> torch.Tensor:
        """``[B]`` unnormalised log joint of a full assignment.

        z: ``[B, N]`` labels of every node; h: ``[B, C, N]`` heads (ignored for padding and
        for nodes with no legal head); g: ``[B, n]`` global values (needed iff global_labels).
        An illegal head gives ``-inf`` (the assignment has zero potential).
        """
        self.check_factor_graph()
        tokens, mask = self.check_inputs(tokens, mask)
        self.check_parameters()
        B, n = tokens.shape
        N = self.topology.num_nodes(n)
        z, h = (
            check_assignment("z", z, (B, N), self.labels),
            check_assignment("h", h, (B, self.channels, N), N),
        )
        arcs = self.arc_mask(mask)
        score = self.unary_table(tokens, mask).gather(-1, z[..., None]).squeeze(-1).sum(-1)

        has_head = arcs.any(-1)  # [B, N]
        table = self.ternary_tensor()  # [K, C, d, d]
        groups = self.distance_groups(n).to(z.device)
        batch, channel, node = torch.meshgrid(
            torch.arange(B), torch.arange(self.channels), torch.arange(N), indexing="ij"
        )
        head_label = z[batch, h]
        arc_score = table[groups[node, h], channel, z[batch, node], head_label]
        legal = arcs[batch, node, h]
        counted = has_head[:, None, :].expand_as(arc_score)
        arc_score = torch.where(legal, arc_score, torch.full_like(arc_score, -math.inf))
        score = score + torch.where(counted, arc_score, torch.zeros_like(arc_score)).sum((1, 2))

        if self.global_labels:
            if g is None:
                raise ValueError("g is required: this CRF has global_labels > 0")
            g = check_assignment("g", g, (B, n), self.global_labels)
            pair = self.binary[g, z[:, :n]]
            score = score + (pair * mask).sum(-1)
        elif g is not None:
            raise ValueError("g must be None: this CRF has no global variables (global_labels=0)")
        if len(self.factors):  # extra templates see padded nodes as label 0
            labels = z.masked_fill(~self.node_mask(mask), 0)
            for factor in self.factors:
                score = score + factor.log_potential(labels, tokens, mask)
        return score

    def templates(self) -> list:
        """The factor templates of this CRF, in the order they write the model: the
        built-ins (``Unary``, ``Global`` when global_labels > 0, ``Ternary``), then the
        extra ``factors``."""
        built_in = [Unary()] + ([Global()] if self.global_labels else []) + [Ternary()]
        return built_in + list(self.factors)

    def model(self, tokens=None, mask=None, embeddings=None):
        """The CRF as a Pyro model, generated from its templates: one enumerable
        ``Categorical`` site per variable (``z_i``, ``h_c_i``, ``g_i``; ``infer["variable"]``
        is "Z", "H" or "G") and factor sites written by each template (``infer["template"]``
        names it; see ``graphs.factors``).

        Sites carry uniform priors; each variable's factor adds back the log of its
        number of values, so the model's evidence is exactly the CRF's partition
        function. Padded tokens get no factors (their sites integrate to one) and are
        never heads; a node with no legal head in a channel gets no head site.
        ``embeddings [B, n, D]`` instead of ``tokens`` for a CRF with ``embedding_size``.
        """
        self.check_factor_graph()
        inputs, mask = self.check_any(tokens, mask, embeddings)
        self.check_parameters()
        write_model(self, inputs, mask)  # graphs.crf_model


def _check_sizes(vocab_size, embedding_size, labels, channels, rank, global_labels) -> tuple[int, int]:
    """``(rows of the unary table, rank)``: exactly one of ``vocab_size`` (token ids in) and
    ``embedding_size`` (embeddings in), every size an integer in its range; the rank
    defaults to the number of labels."""
    if (vocab_size is None) == (embedding_size is None):
        raise ValueError(
            f"give exactly one of vocab_size (token ids in) and embedding_size (embeddings in), "
            f"got vocab_size={vocab_size!r}, embedding_size={embedding_size!r}"
        )
    if embedding_size is not None:
        check_size("embedding_size", embedding_size, minimum=1, maximum=MAX_EMBEDDING_SIZE)
    else:
        check_size("vocab_size", vocab_size, minimum=1)
    check_size("labels", labels, minimum=1)
    check_size("channels", channels, minimum=1)
    rank = labels if rank is None else rank
    check_size("rank", rank, minimum=1)
    check_size("global_labels", global_labels, minimum=0)
    return (vocab_size if embedding_size is None else embedding_size), rank


def _check_global_memory(global_memory: str, global_labels: int, labels: int) -> None:
    if global_memory not in GLOBAL_MEMORIES:
        raise ValueError(f"global_memory must be one of {list(GLOBAL_MEMORIES)}, got {global_memory!r}")
    sub_keys = math.isqrt(global_labels)
    if global_memory == "product_key" and (global_labels < 1 or sub_keys**2 != global_labels or labels < 2):
        raise ValueError(
            f"global_memory='product_key' needs global_labels = s^2 >= 1 and labels >= 2, got {global_labels}"
        )
