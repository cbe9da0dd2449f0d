"""Exact inference by enumerating a Pyro model: a ``graphs.CRF`` declaration or any Pyro
function whose latent sites are discrete and enumerable.

A declaration's model (``crf.model``, generated from its factor templates) is run under
``poutine.enum`` so that every discrete site holds all its values in a tensor dimension
of its own; the log-probabilities of all sites are then summed out one variable at a time
(variable elimination in log space). Nothing here restates the CRF's formula: what the
model says (every template's sites, and any site an overridden ``model`` adds) is what is
summed.

Precision: the model runs on float64 copies of the CRF's parameters (gradients still
reach the originals) and every elimination is a log-sum-exp shifted by the maximum of
its whole bucket, so log Z is right to float64 rounding at any finite potential.
(Pyro's log-einsum backend shifts each operand by its own maximum, so the products of
two shifted operands underflow to 0 at potentials of ~1e2 in float32 and ~1e3 in
float64: log Z came out silently too small or ``-inf``.) ``log_partition`` is always
float64; ``marginals`` returns a ``Posterior`` in the CRF's dtype (the Posterior contract,
``inference.posterior``): probabilities and log Z cast back, log Z differentiable.

The cost grows like d ** N (N = tokens + virtual nodes): eliminating one head
variable couples its node's label with every label it may attend to. ``Exact``
refuses inputs above ``max_configurations`` label configurations per sentence.

Any other Pyro function goes through Pyro's own machinery (``TraceEnum_ELBO``'s
enumeration and ``pyro.ops.contract``, which handles nested plates and ``pyro.markov``),
with every log-factor cast to float64 before it is contracted (the function's own
arithmetic stays in its dtype). Its size guard: no site's enumerated log-probability may
hold more than ``max_configurations`` entries per element of the batch plate.
"""

from __future__ import annotations

import math

import opt_einsum
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import config_enumerate
from pyro.ops.special import safe_log
from pyro.poutine.util import site_is_subsample
from torch import nn

from inference.posterior import Posterior

__all__ = ["Exact"]

_MAX_BUCKET = 2**24  # entries (batch included) of the largest joint factor elimination may build


def is_declaration(model) -> bool:
    """True for a ``graphs.CRF`` (or a subclass): a module with a Pyro ``model`` and the
    CRF's input check."""
    return isinstance(model, nn.Module) and callable(getattr(model, "model", None)) and hasattr(model, "check_inputs")


class Exact:
    """Exact inference by enumeration: the oracle for tiny models.

    Args:
        model: a ``graphs.CRF`` declaration, or a Pyro function whose latent sites are
            discrete and enumerable (``Categorical``, ``Bernoulli`` ...).
        max_configurations: the size guard. For a declaration: refuse sentences where
            ``labels ** N`` exceeds it; for a function: refuse a site whose enumerated
            log-probability has more entries than this per batch element.

    ``Exact(crf)(tokens, mask)`` is ``marginals``: the call every engine answers.
    """

    def __init__(self, model, max_configurations: int = 2**16):
        if isinstance(max_configurations, bool) or not isinstance(max_configurations, int) or max_configurations < 1:
            raise ValueError(f"max_configurations must be >= 1 (an integer), got {max_configurations!r}")
        self.max_configurations = max_configurations
        if is_declaration(model):
            from inference.declaration import compile_templates, model_is_overridden

            if not model_is_overridden(model):  # an overridden model is summed as it is written
                compile_templates(model, "Exact")  # a factor Exact cannot score is refused now, not at call time
            self.crf, self.function = model, None
        elif callable(model) and not isinstance(model, nn.Module):
            self.crf, self.function = None, model
        else:
            raise TypeError(
                f"crf must be a graphs.CRF, got {type(model).__name__} (Exact also takes a Pyro function whose "
                f"latent sites are discrete and enumerable)"
            )

    def __call__(self, *args, **kwargs):
        return self.marginals(*args, **kwargs)

    def log_partition(self, *args, **kwargs) -> torch.Tensor:
        """The log of the model's total unnormalised mass, float64. A declaration:
        ``log_partition(tokens, mask=None)`` (or ``embeddings=x`` for a CRF with ``embedding_size``)
        -> ``[B]``, log Z of each sentence. A function:
        ``log_partition(*args, **kwargs)`` (its own arguments) -> ``[B]`` over its outermost
        plate (the plate every sample site is in), a scalar if it has none."""
        if self.function is not None:
            from inference.reference import enumeration  # Pyro's machinery, for any function

            return enumeration.log_partition(self.function, args, kwargs, self.max_configurations)
        factors, _, letters = self._factors(*self.crf.check_any(*args, **kwargs))
        return _eliminate(factors, letters)

    def marginals(self, *args, **kwargs):
        """A declaration: ``marginals(tokens, mask=None)`` -> ``Posterior`` with the exact
        marginals of every label, head and global variable, and log Z. A function: a dict
        from each enumerated latent site's name to its probabilities ``[..., k]`` over its
        k values (``enumerate_support`` order), the batch shape of the site first."""
        if self.function is not None:
            from inference.reference import enumeration

            return enumeration.marginals(self.function, args, kwargs, self.max_configurations)
        return self._declaration_marginals(*self.crf.check_any(*args, **kwargs))

    def _declaration_marginals(self, inputs, mask) -> Posterior:
        """A zero "probe" factor is added on every site's own dimension; the gradient of
        log Z with respect to it is that site's marginal."""
        factors, sites, letters = self._factors(inputs, mask)
        B = mask.shape[0]
        differentiable = torch.is_grad_enabled() and any(f.requires_grad for f in factors)
        with torch.enable_grad():
            probes = {}
            for name, letter in sites.items():
                size = next(f.shape[ls.index(letter)] for f, ls in zip(factors, letters) if letter in ls)
                probes[name] = torch.zeros(
                    size, B, dtype=factors[0].dtype, device=factors[0].device, requires_grad=True
                )
            log_z = _eliminate(factors + list(probes.values()), letters + [sites[k] + _BATCH for k in probes])
            # the graph to the parameters is kept: log Z from the call is differentiable
            grads = torch.autograd.grad(log_z.sum(), list(probes.values()), retain_graph=differentiable)
        dtype = self.crf.unary.dtype  # the Posterior contract: every field in the CRF's dtype
        probs = {name: grad.T.to(dtype) for name, grad in zip(probes, grads)}  # [B, size]

        n = mask.shape[1]
        N, C = self.crf.topology.num_nodes(n), self.crf.channels
        nodes = self.crf.node_mask(mask)
        has_head = self.crf.arc_mask(mask).any(-1)  # [B, N]
        z = torch.stack([probs[f"z_{i}"] for i in range(N)], dim=1) * nodes[..., None]
        h = z.new_zeros(B, C, N, N)
        for c in range(C):
            for i in range(N):
                if f"h_{c}_{i}" in probs:
                    h[:, c, i] = probs[f"h_{c}_{i}"] * has_head[:, i, None]
        g = None
        if self.crf.global_labels:
            g = torch.stack([probs[f"g_{i}"] for i in range(n)], dim=1) * mask[..., None]
        log_z = log_z if differentiable else log_z.detach()
        return Posterior(z=z, h=h, g=g, log_partition=log_z.to(dtype))

    def _factors(self, inputs, mask):
        """Trace the enumerated model; return its log-factors with einsum letters.

        Every factor is expanded along the batch plate (dim -1) so that each
        enumerated variable is per-sentence; size-1 enumeration dims are dropped.
        Returns (factors, {site name: its letter}, [letters of each factor]).
        """
        B, n = mask.shape
        N = self.crf.topology.num_nodes(n)
        configurations = self.crf.labels**N
        if configurations > self.max_configurations:
            raise ValueError(
                f"Exact enumeration of {N} nodes (sentence length n={n} + "
                f"{self.crf.topology.extra_nodes} virtual) with labels={self.crf.labels} needs "
                f"{configurations} label configurations, above max_configurations="
                f"{self.max_configurations}; use shorter inputs, fewer labels, or inference.Gibbs"
            )
        trace = _trace_in_float64(self.crf, inputs, mask)

        factors, letters, sites = [], [], {}
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or site_is_subsample(site):
                continue
            log_prob = site["log_prob"]
            if not site["is_observed"] and site["mask"] is not None:
                # a mask drops an observation's term; an enumerated latent keeps its prior (it sums
                # to 1 where nothing reads it), as Pyro's TraceEnum_ELBO and the function path do
                log_prob = scale_and_mask(site["unscaled_log_prob"], site["scale"])
            log_prob = log_prob.expand(*log_prob.shape[:-1], B) if log_prob.dim() else log_prob.expand(B)
            own = None
            if not site["is_observed"]:
                own = sites[name] = -log_prob.dim()  # its enumeration dim is the leftmost
            # size-1 dims are broadcasts, except a site's own dim when it has one value
            keep = [k for k in range(-log_prob.dim(), -1) if log_prob.shape[k] > 1 or k == own]
            drop = tuple(k for k in range(-log_prob.dim(), -1) if k not in keep)
            factors.append(log_prob.squeeze(drop))
            letters.append("".join(_letter(k) for k in keep) + _BATCH)
        sites = {name: _letter(k) for name, k in sites.items()}
        return factors, sites, letters


class _EnumeratedModel(nn.Module):
    """The CRF's enumerated Pyro model as a module call, so that torch.func.functional_call
    can run it on float64 copies of the parameters."""

    def __init__(self, crf):
        super().__init__()
        self.crf = crf

    def forward(self, inputs, mask):
        model = poutine.enum(config_enumerate(self.crf.model, "parallel"), first_available_dim=-2)
        if self.crf.embedding_size is None:
            trace = poutine.trace(model).get_trace(inputs, mask)
        else:
            trace = poutine.trace(model).get_trace(None, mask, embeddings=inputs)
        trace.compute_log_prob()
        return trace


def _trace_in_float64(crf, inputs, mask):
    """Trace of the enumerated model with every floating parameter and buffer cast up to
    float64 (differentiably): the potentials (e.g. the ternary table u v^T) are then built
    and summed without float32 rounding."""
    wide = {
        f"crf.{name}": t.double() if t.is_floating_point() else t
        for name, t in [*crf.named_parameters(), *crf.named_buffers()]
    }
    if inputs.is_floating_point():  # embeddings meet the float64 unary table
        inputs = inputs.double()
    return torch.func.functional_call(_EnumeratedModel(crf), wide, (inputs, mask))


def _eliminate(factors: list[torch.Tensor], letters: list[str]) -> torch.Tensor:
    """Sum out every enumerated variable in log space, one bucket at a time, keeping
    the batch plate: ``[B]``. The plan is made from the shapes alone (and refused if one
    sentence is too large) before anything is computed; the batch then goes through in
    chunks that keep every bucket under _MAX_BUCKET entries."""
    size = {}
    for f, ls in zip(factors, letters):
        size.update(zip(ls, f.shape))
    steps, largest = _plan(list(letters), {**size, _BATCH: 1})
    chunk = max(1, _MAX_BUCKET // largest)
    results = []
    for start in range(0, size[_BATCH], chunk):
        part, part_letters = [f[..., start : start + chunk] for f in factors], list(letters)
        for bucket, out in steps:
            new = _log_sum_product([part[i] for i in bucket], [part_letters[i] for i in bucket], out)
            part = [f for i, f in enumerate(part) if i not in bucket] + [new]
            part_letters = [ls for i, ls in enumerate(part_letters) if i not in bucket] + [out]
        results.append(_log_sum_product(part, part_letters, _BATCH))
    return torch.cat(results)


def _plan(letters: list[str], size: dict[str, int]) -> tuple[list[tuple[list[int], str]], int]:
    """Elimination steps as (indices of the factors in the bucket, letters of the new
    factor), and the entries of the largest bucket. Greedy order: the variable whose
    bucket yields the smallest factor goes first (a head variable couples its node's label
    with every label it may attend to; summing it out early keeps factors small). Each
    bucket's joint is built in full, so refuse a plan whose largest exceeds _MAX_BUCKET."""
    remaining = set("".join(letters)) - {_BATCH}

    def cost(letter):
        joined = set().union(*(ls for ls in letters if letter in ls)) - {letter}
        return math.prod(size[x] for x in joined)

    steps, largest = [], 1
    while remaining:
        letter = min(sorted(remaining), key=cost)
        remaining.discard(letter)
        bucket = [i for i, ls in enumerate(letters) if letter in ls]
        joined = set().union(*(letters[i] for i in bucket))
        entries = math.prod(size[x] for x in joined)
        if entries > _MAX_BUCKET:
            raise ValueError(
                f"Exact elimination would build a factor of {entries} entries per sentence, above the "
                f"limit {_MAX_BUCKET}; use shorter inputs, fewer labels or channels, or inference.Gibbs"
            )
        largest = max(largest, entries)
        out = "".join(sorted(joined - {letter, _BATCH})) + _BATCH
        steps.append((bucket, out))
        letters = [ls for i, ls in enumerate(letters) if i not in bucket] + [out]
    return steps, largest


def _log_sum_product(factors: list[torch.Tensor], letters: list[str], out: str) -> torch.Tensor:
    """``log sum exp(sum of factors)`` over every letter not in ``out``, as a tensor with
    letters ``out``. The bucket's joint is built in full (tiny CRFs only) and shifted by
    its own maximum over the summed letters, so no product of separately shifted terms can
    underflow: exact to rounding for potentials of any size."""
    joint = sorted(set().union(*letters) - {_BATCH}) + [_BATCH]
    total = 0
    for f, ls in zip(factors, letters):
        present = [x for x in joint if x in ls]
        f = f.permute([ls.index(x) for x in present])
        total = total + f.reshape([f.shape[present.index(x)] if x in ls else 1 for x in joint])
    summed = [i for i, x in enumerate(joint) if x not in out]
    if summed:
        # a slice that is all -inf (impossible) keeps a finite shift and sums to log 0 = -inf
        shift = total.detach().amax(summed, keepdim=True).clamp(min=torch.finfo(total.dtype).min)
        total = (shift + safe_log((total - shift).exp().sum(summed, keepdim=True))).squeeze(summed)
    kept = [x for x in joint if x in out]
    return total.permute([kept.index(x) for x in out])


def _letter(dim: int) -> str:
    """The einsum symbol of the (negative) tensor dim ``dim``; the batch plate is dim -1."""
    return opt_einsum.get_symbol(-dim)


_BATCH = _letter(-1)
