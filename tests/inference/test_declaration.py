"""The declaration of a factor graph as a model (inference.declaration): every site names its
template, what is not a template is refused, a plain function model gives the same answers,
and an engine that would ignore a raw factor refuses it."""

import math

import pyro
import pytest
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample

import graphs
import inference
from graphs.factors import Pairwise
from tests.builders import FirstLastAgree

OVERRIDES = {
    "a raw factor": lambda crf, tokens, mask: pyro.factor("bonus", torch.full((), 1.0)),
    "a new latent": lambda crf, tokens, mask: pyro.sample(
        "extra", pyro.distributions.Categorical(logits=torch.zeros(2))
    ),
    "a factor only longer sentences reach": lambda crf, tokens, mask: (
        pyro.factor("skip", torch.full((), 1.0)) if tokens.shape[1] > 2 else None
    ),
    "nothing added": lambda crf, tokens, mask: None,
}


@pytest.mark.parametrize("added", sorted(OVERRIDES))
@pytest.mark.parametrize("scaled", [False, True])
def test_an_overridden_model_is_refused_by_every_engine_that_reads_templates(added, scaled):
    """Whatever the override does (a site, a site a two-token trace never reaches, a scale
    around the whole model, or nothing), the engines that read the templates would not see
    it: refused by name; Exact sums the model itself."""

    class Overridden(graphs.CRF):
        def model(self, tokens, mask=None):
            with poutine.scale(scale=2.0 if scaled else 1.0):
                super().model(tokens, mask)
                OVERRIDES[added](self, tokens, mask)

    crf = Overridden(vocab_size=4, labels=2)
    for engine in (inference.MeanField, inference.Gibbs, inference.TemperedSMC):
        with pytest.raises(ValueError, match=r"cannot compile Overridden.model: it overrides CRF.model"):
            engine(crf)
    if added != "a new latent" and not scaled:
        inference.Exact(crf).log_partition(torch.tensor([[1, 2, 3]]))  # sums the model itself


def test_every_site_of_the_generated_model_names_its_template():
    crf = graphs.CRF(
        vocab_size=4, labels=2, global_labels=2, topology="chain()", factors=[Pairwise(2), FirstLastAgree()]
    )
    trace = poutine.trace(crf.model).get_trace(torch.tensor([[1, 2, 3]]))
    found = {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        key = site["infer"].get("template") if site["is_observed"] else site["infer"].get("variable")
        found.setdefault(key, set()).add(name)
    assert found["Unary"] == {"unary_0", "unary_1", "unary_2"}
    assert found["Global"] == {"binary_0", "binary_1", "binary_2"}
    assert found["Pairwise"] == {"pairwise0_1_0", "pairwise0_2_1"}
    assert found["FirstLastAgree"] == {"firstlastagree1"}
    assert found["Ternary"] == {"head_count_0_1", "head_count_0_2", "ternary_0_1_0", "ternary_0_2_1"}
    assert found["Z"] == {"z_0", "z_1", "z_2"} and found["G"] == {"g_0", "g_1", "g_2"}
    assert found["H"] == {"h_0_1", "h_0_2"}
    assert None not in found


def test_declaration_refuses_what_is_not_a_factor_template():
    with pytest.raises(TypeError, match=r"factors\[0\] must be a graphs.Factor"):
        graphs.CRF(vocab_size=4, labels=2, factors=["pairwise"])
    with pytest.raises(TypeError, match="Unary is built in"):
        graphs.CRF(vocab_size=4, labels=2, factors=[graphs.factors.Unary()])
    with pytest.raises(TypeError, match="factors must be a list"):
        graphs.CRF(vocab_size=4, labels=2, factors=Pairwise(2))
    with pytest.raises(ValueError, match=r"Pairwise\(labels=3\) does not match the CRF's labels=2"):
        graphs.CRF(vocab_size=4, labels=2, factors=[Pairwise(3)])
    with pytest.raises(ValueError, match="Pairwise topology must have no virtual nodes"):
        Pairwise(2, "star()")
    with pytest.raises(ValueError, match="names must be unique"):
        a, b = Pairwise(2), Pairwise(2)
        a.name = b.name = "same"
        graphs.CRF(vocab_size=4, labels=2, factors=[a, b])


def test_a_declaration_s_model_as_a_plain_function_gives_the_same_log_z_and_marginals():
    """crf.model handed to Exact as a Pyro function goes through Pyro's enumeration and
    contraction, not the declaration's own elimination: both must agree."""
    torch.manual_seed(7)
    crf = graphs.CRF(
        vocab_size=5, labels=2, channels=2, rank=2, global_labels=2, topology="window(1)", factors=[Pairwise(2)]
    ).double()
    tokens = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        declared = inference.Exact(crf)(tokens, mask)
        as_function = inference.Exact(crf.model)
        torch.testing.assert_close(as_function.log_partition(tokens, mask), declared.log_partition, atol=1e-10, rtol=0)
        marginals = as_function.marginals(tokens, mask)
    for i in range(3):
        torch.testing.assert_close(marginals[f"z_{i}"][mask[:, i]], declared.z[:, i][mask[:, i]], atol=1e-10, rtol=0)


class Either(graphs.Factor):
    """Label 1 at the first token scores 0.7, as a labelling and as an expectation."""

    def log_potential(self, z, tokens, mask):
        return 0.7 * (z[:, 0] == 1).double()

    def expected_log_potential(self, q, tokens, mask):
        return 0.7 * q[:, 0, 1]


def user_factor(scores: bool, expects: bool) -> graphs.Factor:
    """A user factor that implements log_potential iff ``scores`` and its expectation iff ``expects``."""
    methods = {"log_potential": Either.log_potential} if scores else {}
    methods |= {"expected_log_potential": Either.expected_log_potential} if expects else {}
    return type("Partial", (graphs.Factor,), methods)()


# what each engine needs of a user factor, restated from docs/factors.md's table
NEEDS = {"Exact": "log_potential", "Gibbs": "log_potential", "TemperedSMC": "log_potential"}
NEEDS["MeanField"] = "expected_log_potential"
BUILDERS = {
    "Exact": inference.Exact,
    "MeanField": inference.MeanField,
    "Gibbs": lambda crf: inference.Gibbs(crf, num_samples=2, num_warmup=0, num_chains=1),
    "TemperedSMC": inference.TemperedSMC,
}


@pytest.mark.parametrize("engine", sorted(BUILDERS))
@pytest.mark.parametrize("scores", [False, True])
@pytest.mark.parametrize("expects", [False, True])
def test_every_engine_refuses_when_built_a_user_factor_missing_what_it_needs(engine, scores, expects):
    crf = graphs.CRF(
        vocab_size=5, labels=2, channels=1, rank=2, topology="chain()", factors=[user_factor(scores, expects)]
    )
    has = {"log_potential": scores, "expected_log_potential": expects}
    able = [name for name in ("Exact", "MeanField", "Gibbs") if has[NEEDS[name]]]
    if has[NEEDS[engine]]:
        BUILDERS[engine](crf)
        return
    message = rf"{engine if engine != 'TemperedSMC' else 'Gibbs'} cannot compile factor 'partial0' \(Partial\) "
    message += rf"\(implement {NEEDS[engine]}\(.*engines that can: {', '.join(able) or 'none'}$"
    with pytest.raises(ValueError, match=message):
        BUILDERS[engine](crf)


def test_exact_refuses_an_expectation_only_factor_when_built_and_scores_a_log_potential_only_one():
    """Built, it used to fail only when called (NotImplementedError from log_potential)."""
    crf = graphs.CRF(vocab_size=5, labels=2, factors=[user_factor(scores=False, expects=True)])
    with pytest.raises(ValueError, match="Exact cannot compile factor 'partial0'"):
        inference.Exact(crf)
    crf = graphs.CRF(vocab_size=5, labels=2, topology="chain()", factors=[user_factor(scores=True, expects=False)])
    plain = graphs.CRF(vocab_size=5, labels=2, topology="chain()")
    plain.load_state_dict(crf.state_dict())
    tokens = torch.tensor([[1, 3]])
    with torch.no_grad():  # log Z with the factor: each labelling weighted by exp(0.7) when z_0 = 1
        p_first = inference.Exact(plain)(tokens).z[0, 0, 1].double()
        expected = inference.Exact(plain).log_partition(tokens) + torch.log1p(p_first * math.expm1(0.7))
        torch.testing.assert_close(inference.Exact(crf).log_partition(tokens), expected)
