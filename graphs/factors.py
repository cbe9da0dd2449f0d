"""Factor templates: what a ``graphs.CRF`` is made of, and how it becomes a Pyro model.

A CRF is its variables (token labels Z, head choices H per channel, global labels G)
and a list of factor templates. Every CRF has the built-in ones,

    Unary     log phi(Z_i = a)                     = unary[w_i, a]
    Global    log phi(Z_i = a, G_i = m)             = binary[m, a]      (global_labels > 0)
    Ternary   log phi(H_i^c = j, Z_i = a, Z_j = b)  = T[k(i, j), c, a, b] (low-rank, CP or Tucker)

whose parameters live on the CRF itself (``crf.unary``, ``crf.ternary_u`` ...), and
``CRF(factors=[...])`` adds more:

    Pairwise  log phi(Z_i = a, Z_j = b) = table[k(i, j), a, b] on the arcs (i, j) of its own
              topology (k = distance group); ``Pairwise(d, "chain()")`` is the linear-chain CRF
    Factor    a user subclass: ``log_potential(z, tokens, mask) -> [B]`` of a full labelling,
              optionally ``expected_log_potential(q, tokens, mask) -> [B]`` under factorised
              label marginals q (MeanField's messages are its gradient in q)

Every template writes its own sites into ``CRF.model``; each factor site records the
template that made it in its ``infer`` dict (``infer["template"]``, e.g. ``"Pairwise"``)
and each variable site its kind (``infer["variable"]``: ``"Z"``, ``"H"`` or ``"G"``), so a
trace says where every term came from and engines can check that they compile all of it
(``inference.declaration``).

Shapes: ``tokens [B, n]`` (the CRF's inputs: token ids, or embeddings ``[B, n, D]`` for a
CRF with ``embedding_size``), ``mask [B, n]`` (True for real tokens), ``z [B, N]`` labels of
every node and ``q [B, N, d]`` label marginals, N = n + the topology's virtual nodes
(N = n for topologies without virtual nodes). Padded nodes hold label 0 (``z``) or a zero
row (``q``): a factor should ignore them, as the built-ins do, by reading ``mask``.

Pyro is imported only when a model is generated; the potentials need torch alone.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from graphs import topology as topologies

__all__ = ["Factor", "Unary", "Ternary", "Global", "Pairwise", "BUILT_IN", "factor_site", "check_templates"]


def factor_site(name: str, log_factor: torch.Tensor, template: str) -> None:
    """``pyro.factor`` that records its template in the site's ``infer`` dict."""
    import pyro
    import pyro.distributions as dist

    unit = dist.Unit(log_factor)
    pyro.sample(name, unit, obs=unit.sample(), infer={"is_auxiliary": True, "template": template})


class Factor(nn.Module):
    """A user factor over the labels of a sentence. Subclass it and implement
    ``log_potential``; implement ``expected_log_potential`` too for MeanField.

    A factor is an ``nn.Module``: its parameters train with the CRF's. Its sites in the
    Pyro model are named after ``name`` (default: the class name, lower case, made unique
    by the CRF) and carry ``infer={"template": <class name>}``.
    """

    name: str | None = None

    @property
    def template(self) -> str:
        return type(self).__name__

    def log_potential(self, z: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B]`` log phi of full labellings ``z [B, N]`` (long)."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_potential(z, tokens, mask) -> [B]")

    def expected_log_potential(self, q: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B]`` E_q[log phi] under factorised label marginals ``q [B, N, d]``: must be
        multilinear in the rows of q (it is, for any expectation under a factorised q)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no expected_log_potential(q, tokens, mask): MeanField cannot use it"
        )

    def has_log_potential(self) -> bool:
        """True when the subclass overrides ``log_potential`` (what Exact and Gibbs score)."""
        return type(self).log_potential is not Factor.log_potential

    def has_expectation(self) -> bool:
        """True when the subclass overrides ``expected_log_potential``."""
        return type(self).expected_log_potential is not Factor.expected_log_potential

    def check(self, crf) -> None:
        """Called when the factor joins ``crf``: raise if it cannot belong to it."""

    def add_to_model(self, crf, scope) -> None:
        """One factor site of ``log_potential`` over the enumerated labels. Under Pyro's
        enumeration every ``z_i`` has its own leading dims; the labellings are broadcast to
        a plain ``[B', N]`` batch, so ``log_potential`` sees ordinary tensors."""
        z = torch.stack(torch.broadcast_tensors(*scope.z), dim=-1)  # [*enum, B, N]
        z = z.masked_fill(~scope.nodes, 0)  # padded nodes read as label 0, as in CRF.log_potential
        lead = z.shape[:-2]
        inputs, B = scope.inputs, scope.mask.shape[0]
        flat_z = z.reshape(-1, z.shape[-1])
        repeat = flat_z.shape[0] // B
        if repeat > 1:  # every enumerated labelling of a sentence sees that sentence's inputs
            inputs = inputs.expand(*lead, *inputs.shape).reshape(-1, *inputs.shape[1:])
        mask = scope.mask.expand(*lead, *scope.mask.shape).reshape(-1, scope.mask.shape[1])
        value = self.log_potential(flat_z, inputs, mask)
        if not isinstance(value, torch.Tensor) or value.shape != (flat_z.shape[0],):
            raise ValueError(
                f"{self.template}.log_potential must return a tensor of shape [B] = [{flat_z.shape[0]}], "
                f"got {getattr(value, 'shape', type(value).__name__)}"
            )
        factor_site(self.name, value.reshape(*lead, B), self.template)


# what a Pairwise means: the engines read its table through these, and nothing else
PAIRWISE_SEMANTICS = ("log_potential", "expected_log_potential", "message", "tables", "arcs", "add_to_model")


class Pairwise(Factor):
    """Label-label potentials on the arcs of a topology: ``table [K, d, d]``, one ``[d, d]``
    table per distance group k(i, j) (``gamma`` as in ``graphs.CRF``; ``2 * (gamma + 1)``
    groups), ``log phi(Z_i = a, Z_j = b) = table[k(i, j), a, b]`` for every arc i -> j of
    ``topology`` between real tokens. ``topology="chain()"`` (arcs i -> i - 1) with one
    group per direction is the linear-chain CRF: ``table[gamma + 1]`` is the transition
    matrix from the previous label to the next.

    The topology must have no virtual nodes (the factor is over token labels).
    """

    def __init__(self, labels: int, topology="chain()", gamma: int = 0):
        super().__init__()
        if isinstance(labels, bool) or not isinstance(labels, int) or labels < 1:
            raise ValueError(f"Pairwise labels must be an integer >= 1, got {labels!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, int) or not 0 <= gamma <= 2**12:
            raise ValueError(f"Pairwise gamma must be an integer in [0, 4096], got {gamma!r}")
        self.topology = topologies.parse(topology)
        if self.topology.extra_nodes:
            raise ValueError(
                f"Pairwise topology must have no virtual nodes (it couples token labels), got {self.topology.name!r}"
            )
        self.labels, self.gamma = labels, gamma
        self.table = nn.Parameter(torch.randn(2 * (gamma + 1), labels, labels) * labels**-0.5)

    def extra_repr(self) -> str:
        return f"labels={self.labels}, topology={self.topology.name}, gamma={self.gamma}"

    def check(self, crf) -> None:
        if self.labels != crf.labels:
            raise ValueError(f"Pairwise(labels={self.labels}) does not match the CRF's labels={crf.labels}")
        # the engines compile a Pairwise from its table: a subclass that scores otherwise would be
        # one factor to crf.log_potential and another to every engine
        changed = [name for name in PAIRWISE_SEMANTICS if getattr(type(self), name) is not getattr(Pairwise, name)]
        if changed:
            raise TypeError(
                f"{type(self).__name__} overrides Pairwise.{', Pairwise.'.join(changed)}: the engines compile a "
                "Pairwise from its table, so they would not see the change; derive a factor that scores otherwise "
                "from graphs.Factor (log_potential, and expected_log_potential for MeanField)"
            )

    def arcs(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, n, n]`` the arcs between real tokens of each row."""
        return self.topology.arcs(mask)

    def tables(self, n: int) -> torch.Tensor:
        """``[n, n, d, d]`` the log-potential table of every position pair (use with ``arcs``)."""
        return self.table[self._groups(n)]

    def log_potential(self, z, tokens, mask):
        n = tokens.shape[1]
        arcs = self.arcs(mask)  # [B, n, n]
        z = z[:, :n]
        groups = self._groups(n)
        score = self.table[groups[None], z[:, :, None], z[:, None, :]]  # [B, n, n]
        return torch.where(arcs, score, torch.zeros_like(score)).sum((1, 2))

    def expected_log_potential(self, q, tokens, mask):
        q = q[:, : tokens.shape[1]]
        return (self._outgoing(q, self._arcs_by_group(q, mask)) * q).sum((1, 2))

    def message(self, q, tokens, mask) -> torch.Tensor:
        """``[B, n, d]`` the closed-form mean-field message to every label (the gradient of
        ``expected_log_potential`` in q): from the arcs i -> j and from the arcs j -> i."""
        q = q[:, : tokens.shape[1]]
        arcs = self._arcs_by_group(q, mask)  # [B, K, n, n]
        # arcs j -> i: the transposed arcs with the transposed tables
        into = (arcs.transpose(-1, -2) @ (q[:, None] @ self.table)).sum(1)
        return self._outgoing(q, arcs) + into

    def _arcs_by_group(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, K, n, n]`` (q's dtype) the arcs of each distance group. Matrix products by
        group, not one einsum over ``[n, n, d, d]`` tables: memory O(K n^2 + n d^2) rather
        than O(n^2 d^2), and no contraction path chosen from the shapes (which an export
        would freeze to the traced batch and length)."""
        n = mask.shape[1]
        group_ids = torch.arange(self.table.shape[0], device=mask.device)
        in_group = self._groups(n, mask.device)[None] == group_ids[:, None, None]  # [K, n, n]
        return (self.arcs(mask)[:, None] & in_group[None]).to(q.dtype)

    def _outgoing(self, q: torch.Tensor, arcs: torch.Tensor) -> torch.Tensor:
        """``[B, n, d]``: sum over the arcs i -> j of ``table[k(i, j)] @ q_j``."""
        return (arcs @ (q[:, None] @ self.table.transpose(-1, -2))).sum(1)

    def _groups(self, n: int, device=None) -> torch.Tensor:
        # built where it is used: no copy from the CPU in a forward
        return topologies.distance_groups(n, self.gamma, device=self.table.device if device is None else device)

    def add_to_model(self, crf, scope) -> None:
        from pyro.ops.indexing import Vindex

        n = scope.mask.shape[1]
        arcs = self.arcs(scope.mask)
        groups = self._groups(n).tolist()
        zero = self.table.new_zeros(())
        for i in range(n):
            for j in arcs[:, i].any(0).nonzero().flatten().tolist():
                score = Vindex(self.table[groups[i][j]])[scope.z[i], scope.z[j]]
                factor_site(f"{self.name}_{i}_{j}", torch.where(arcs[:, i, j], score, zero), self.template)


class _BuiltIn:
    """A template whose parameters are the CRF's own (``crf.unary`` ...): it reads them."""

    template = ""
    name = ""

    def has_log_potential(self) -> bool:
        return True

    def has_expectation(self) -> bool:
        return True


class Unary(_BuiltIn):
    """``log phi(Z_i = a) = unary[w_i, a]`` (0 for virtual nodes). The site also adds back
    log d, the mass of the uniform prior on Z_i, so the model's evidence is log Z."""

    template = name = "Unary"

    def add_to_model(self, crf, scope) -> None:
        from pyro.ops.indexing import Vindex

        unary = scope.unary
        rows = torch.arange(unary.shape[0], device=unary.device)
        zero = unary.new_zeros(())
        for i, z_i in enumerate(scope.z):
            score = Vindex(unary)[rows, i, z_i] + math.log(crf.labels)
            factor_site(f"unary_{i}", torch.where(scope.nodes[:, i], score, zero), self.template)


class Global(_BuiltIn):
    """``log phi(Z_i = a, G_i = m) = binary[m, a]``: one global variable per token."""

    template = name = "Global"

    def add_to_model(self, crf, scope) -> None:
        import pyro
        import pyro.distributions as dist
        from pyro.ops.indexing import Vindex

        G, B = crf.global_labels, scope.mask.shape[0]
        zero = crf.binary.new_zeros(())
        for i in range(scope.mask.shape[1]):
            logits = crf.binary.new_zeros(B, G)
            g_i = pyro.sample(f"g_{i}", dist.Categorical(logits=logits), infer={"variable": "G"})
            score = Vindex(crf.binary)[g_i, scope.z[i]] + math.log(G)
            factor_site(f"binary_{i}", torch.where(scope.mask[:, i], score, zero), self.template)


class Ternary(_BuiltIn):
    """Head selection: ``log phi(H_i^c = j, Z_i = a, Z_j = b) = T[k(i, j), c, a, b]`` on the
    CRF's topology (any ternary form). Each head variable has a uniform prior over the
    legal heads; ``head_count`` sites add back the log of their number."""

    template = name = "Ternary"

    def add_to_model(self, crf, scope) -> None:
        import pyro
        import pyro.distributions as dist

        n = scope.mask.shape[1]
        table, groups = crf.ternary_tensor(), crf.distance_groups(n).tolist()
        arcs, z, dtype = scope.arcs, scope.z, table.dtype
        zero = table.new_zeros(())
        for c in range(crf.channels):
            for i in range(len(z)):
                legal = arcs[:, i]  # [B, N]
                count = legal.sum(-1)
                if not count.any():
                    continue
                # Rows where i has no legal head get a dummy uniform site with no factors.
                logits = torch.where(legal | (count == 0)[:, None], 0.0, -math.inf).to(dtype)
                h_ci = pyro.sample(f"h_{c}_{i}", dist.Categorical(logits=logits), infer={"variable": "H"})
                log_count = torch.where(count > 0, count.clamp(min=1).to(dtype).log(), zero)
                factor_site(f"head_count_{c}_{i}", log_count, self.template)
                for j in legal.any(0).nonzero().flatten().tolist():
                    score = table[groups[i][j], c][z[i], z[j]]
                    chosen = (h_ci == j) & legal[:, j]
                    factor_site(f"ternary_{c}_{i}_{j}", torch.where(chosen, score, zero), self.template)


BUILT_IN = ("Unary", "Global", "Ternary")

_INDEX = "(0|[1-9][0-9]*)"  # an index as a site name writes it (no sign, no leading zero)
_PYRO_NAMES = ("batch", "_INPUT", "_RETURN")  # the plate of CRF.model, and the nodes Pyro's trace adds


def _site_shape(name: str, shape: str, channels: int) -> bool:
    """True when ``name`` is a site of ``shape`` (``<c>``, ``<i>``, ``<j>``: indices) that a model
    can write: a channel below ``channels``, and an arc's two ends apart (no node heads itself)."""
    parts = re.split("(<[a-z]>)", shape)  # a factor's own name is literal text, never a pattern
    match = re.fullmatch("".join(_INDEX if re.fullmatch("<[a-z]>", p) else re.escape(p) for p in parts), name)
    if match is None:
        return False
    index = dict(zip(re.findall("<([a-z])>", shape), map(int, match.groups())))
    return index.get("c", 0) < channels and ("j" not in index or index["i"] != index["j"])


def _generated_site(crf, name: str) -> str | None:
    """The shape of the site of ``crf.model`` besides the extra factors' (a variable, a
    built-in factor: ``graphs.crf_model``, ``Unary``, ``Global``, ``Ternary``; or a Pyro name)
    that ``name`` can be, or None."""
    if name in _PYRO_NAMES:
        return name
    shapes = ["z_<i>", "unary_<i>", "h_<c>_<i>", "head_count_<c>_<i>", "ternary_<c>_<i>_<j>"]
    shapes += ["g_<i>", "binary_<i>"] if crf.global_labels else []
    return next((shape for shape in shapes if _site_shape(name, shape, crf.channels)), None)


def _refuse_clashing_sites(crf, extra) -> None:
    """Two sites of one name make Pyro fail when it traces the model: refuse an extra factor
    whose site (a user factor's ``<name>``, a ``Pairwise``'s ``<name>_<i>_<j>``) can take the
    name of a generated site or of another factor's. A Pairwise's ``<name>_0_1`` can take a
    generated name exactly when one of its sites can; two Pairwise factors never share a name
    (each name ends in its own name and two indices)."""
    reserved = "z_<i>, unary_<i>, h_<c>_<i>, head_count_<c>_<i>, ternary_<c>_<i>_<j>" + (
        ", g_<i>, binary_<i>" if crf.global_labels else ""
    )
    pairwise = [(k, f) for k, f in enumerate(extra) if isinstance(f, Pairwise)]
    for k, factor in enumerate(extra):
        shape = f"{factor.name}_<i>_<j>" if isinstance(factor, Pairwise) else factor.name
        clash = _generated_site(crf, f"{factor.name}_0_1" if isinstance(factor, Pairwise) else factor.name)
        if clash is not None:
            raise ValueError(
                f"factors[{k}] ({factor.template}) is named {factor.name!r}: its site {shape} would share a name "
                f"with CRF.model's {clash}; reserved: {reserved}, {', '.join(_PYRO_NAMES)} (c < channels = "
                f"{crf.channels}, i != j; a Pairwise named P writes P_<i>_<j>); give the factor another name"
            )
        for m, other in pairwise:
            if other is not factor and _site_shape(factor.name, f"{other.name}_<i>_<j>", crf.channels):
                raise ValueError(
                    f"factors[{k}] is named {factor.name!r}: its site would share a name with factors[{m}]'s "
                    f"{other.name}_<i>_<j> (a Pairwise); give one of them another name"
                )


def check_templates(crf, extra) -> list:
    """A CRF's extra templates ``extra``, each a ``graphs.Factor`` that fits ``crf``, with unique site names."""
    if isinstance(extra, Factor) or not isinstance(extra, list | tuple):
        raise TypeError(f"factors must be a list of graphs.Factor templates, got {type(extra).__name__}")
    names = set()
    for k, factor in enumerate(extra):
        if not isinstance(factor, Factor):
            kind = type(factor).__name__
            built_in = f" ({kind} is built in: every CRF has it)" if kind in BUILT_IN else ""
            raise TypeError(
                f"factors[{k}] must be a graphs.Factor (e.g. graphs.factors.Pairwise){built_in}, got {factor!r}"
            )
        factor.check(crf)
        if factor.name is None:
            factor.name = f"{type(factor).__name__.lower()}{k}"
        if factor.name in names or not isinstance(factor.name, str):
            raise ValueError(
                f"factors[{k}] has the name {factor.name!r} of another factor: names must be unique strings"
            )
        names.add(factor.name)
    _refuse_clashing_sites(crf, extra)
    return list(extra)
