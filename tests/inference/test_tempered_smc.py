"""TemperedSMC against exact answers: Z-hat unbiased and log Z, marginals close to Exact on
enumerable CRFs (every factor kind, padding, a virtual node); the Gibbs moves leave p_beta
invariant (started from exact draws of the enumerated p_beta, checked by chi-square); the
target's log joint is the oracle's; bad input is refused by name."""

import itertools
import math

import pytest
import scipy.stats
import torch

import graphs
import inference
from inference.smc.tempered import gibbs_moves
from inference.smc.tempered.sampler import TemperedSMC
from inference.smc.tempered.target import compile_target
from tests import oracles

pytestmark = pytest.mark.usefixtures("one_thread")

REPLICATES = 50


class ParityBonus(graphs.Factor):
    """A user factor: a bonus when the first two labels agree (the sampler reads its
    log_potential alone; MeanField, the proposal, its expectation)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.7))

    def log_potential(self, z, tokens, mask):
        return self.weight * (z[:, 0] == z[:, 1]).to(self.weight.dtype)

    def expected_log_potential(self, q, tokens, mask):  # for the mean-field proposal only
        return self.weight * (q[:, 0] * q[:, 1]).sum(-1)


def make_case(kind: str):
    torch.manual_seed(3)
    factors, topology, global_labels = [], "full", 0
    if kind == "global":
        global_labels = 2
    elif kind == "pairwise":
        factors = [graphs.factors.Pairwise(3, "chain()")]
    elif kind == "user":
        factors = [ParityBonus()]
    elif kind == "virtual":
        topology = "full | root()"
    crf = graphs.CRF(
        vocab_size=9,
        labels=3,
        channels=2,
        rank=2,
        gamma=1,
        topology=topology,
        global_labels=global_labels,
        factors=factors,
    ).double()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    return crf, tokens, mask


@pytest.mark.parametrize("kind", ["global", "pairwise", "user", "virtual"])
def test_log_z_unbiased_and_marginals_match_exact(kind):
    crf, tokens, mask = make_case(kind)
    exact = inference.Exact(crf)(tokens, mask)
    result = TemperedSMC(crf, num_particles=128, replicates=REPLICATES, seed=0).run(tokens, mask)
    ratios = (result.replicate_log_partition - exact.log_partition).exp()  # [R, B] Z-hat / Z
    standard_error = ratios.std(0) / math.sqrt(REPLICATES)
    assert ((ratios.mean(0) - 1).abs() < 3 * standard_error).all(), (ratios.mean(0), standard_error)
    assert (result.log_partition - exact.log_partition).abs().max() < 0.05
    posterior = result.posterior
    for name in ["z", "h"] + (["g"] if crf.global_labels else []):
        difference = (getattr(posterior, name) - getattr(exact, name)).abs().max()
        assert difference < 0.02, (name, difference)
    assert result.betas[0].eq(0).all() and result.betas[-1].eq(1).all()
    assert (result.betas.diff(dim=0) >= 0).all()
    assert result.ess.shape == (result.steps, REPLICATES, 2)
    assert torch.allclose(result.log_weights.exp().sum(-1), torch.ones(REPLICATES, 2, dtype=torch.float64))


def test_target_log_joint_is_the_oracle_log_potential():
    crf, tokens, mask = make_case("global")
    exact = inference.Exact(crf)(tokens, mask)
    target = compile_target(crf, tokens, mask, exact, 1e-6, 1)
    z, h, g = target.sample_proposal(5, torch.Generator().manual_seed(0))
    mine = target.log_gamma(z, h, g)
    for b in range(2):
        for p in range(5):
            row = tokens[b].tolist()
            expected = oracles.log_potential(
                crf, row, mask[b].tolist(), z[b, p].tolist(), h[b, p].tolist(), g[b, p].tolist()
            )
            assert mine[b, p].item() == pytest.approx(expected, abs=1e-9)


# ---- invariance: exact draws of p_beta, moves, chi-square ---------------------------------


def enumerated_p_beta(crf, tokens_row, mask_row, q, beta):
    """Every labelling of the existing nodes with its log p_beta mass (heads and globals
    summed given the labels), written from the oracle's tables, and the exact conditionals
    of each head and global given the labels."""
    S, T, Bm = oracles._tables(crf)
    n = len(tokens_row)
    heads, exists = oracles.arcs_of(crf, n, mask_row)
    live = [i for i in range(len(exists)) if exists[i]]
    labellings, masses, conditionals = [], [], []
    for values in itertools.product(range(crf.labels), repeat=len(live)):
        z = [0] * len(exists)
        for i, a in zip(live, values):
            z[i] = a
        mass = sum((1 - beta) * q["z"][i, z[i]].log() + beta * (S[tokens_row[i], z[i]] if i < n else 0.0) for i in live)
        rows = {}
        for c in range(crf.channels):
            for i, legal in enumerate(heads):
                if legal:
                    group = [oracles.group_of(i, j, n, *oracles.buckets(crf)) for j in legal]
                    row = torch.stack(
                        [(1 - beta) * q["h"][c, i, j].log() + beta * T[k, c, z[i], z[j]] for j, k in zip(legal, group)]
                    )
                    mass = mass + row.logsumexp(0)
                    rows["h", c, i] = (legal, row.softmax(0))
        if Bm is not None:
            for i in range(n):
                if mask_row[i]:
                    row = (1 - beta) * q["g"][i].log() + beta * Bm[:, z[i]]
                    mass = mass + row.logsumexp(0)
                    rows["g", i] = (list(range(crf.global_labels)), row.softmax(0))
        labellings.append(z)
        masses.append(float(mass))
        conditionals.append(rows)
    return labellings, torch.tensor(masses, dtype=torch.float64), conditionals


def random_proposal(crf, tokens, mask, generator):
    B, n = tokens.shape
    N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels

    def rows(*shape):
        return torch.distributions.Dirichlet(torch.ones(shape[-1], dtype=torch.float64)).sample(shape[:-1])

    torch.manual_seed(int(torch.randint(1000, (1,), generator=generator)))
    return inference.Posterior(z=rows(B, N, d), h=rows(B, C, N, N), g=rows(B, n, G) if G else None)


@pytest.mark.parametrize("kind", ["global", "pairwise", "user", "virtual"])
def test_moves_leave_p_beta_invariant(kind):
    crf, tokens, mask = make_case(kind)
    tokens, mask = tokens[1:, :3], mask[1:, :3]  # three tokens: 27 labellings
    generator = torch.Generator().manual_seed(5)
    proposal = random_proposal(crf, tokens, mask, generator)
    beta, draws = 0.6, 4000
    target = compile_target(crf, tokens, mask, proposal, 0.0, 1)
    q = {"z": target.log_qz[0].exp(), "h": target.log_qh[0].exp()}
    if crf.global_labels:
        q["g"] = target.log_qg[0].exp()
    labellings, masses, conditionals = enumerated_p_beta(crf, tokens[0].tolist(), mask[0].tolist(), q, beta)
    if kind == "user":  # the oracle's masses lack the extra factors: add them
        bonus = torch.tensor([0.7 * beta * (z[0] == z[1]) for z in labellings], dtype=torch.float64)
        masses = masses + bonus
    if kind == "pairwise":
        factor = crf.factors[0]
        arcs = factor.topology.arcs(mask)[0].nonzero().tolist()  # the topology is data
        table = factor.table.detach()
        masses = masses + torch.tensor(
            [beta * sum(float(table[oracles.group_of(i, j, 3, 0), z[i], z[j]]) for i, j in arcs) for z in labellings],
            dtype=torch.float64,
        )
    probs = (masses - masses.logsumexp(0)).exp()
    chosen = torch.multinomial(probs, draws, replacement=True, generator=generator)
    z = torch.tensor([labellings[k] for k in chosen.tolist()])[None]
    N = z.shape[-1]
    h = torch.zeros(1, draws, crf.channels, N, dtype=torch.long)
    g = torch.zeros(1, draws, 3, dtype=torch.long) if crf.global_labels else None
    for p, k in enumerate(chosen.tolist()):
        for key, (values, row) in conditionals[k].items():
            value = values[int(torch.multinomial(row, 1, generator=generator))]
            if key[0] == "h":
                h[0, p, key[1], key[2]] = value
            else:
                g[0, p, key[1]] = value
    with torch.no_grad():
        for _ in range(2):
            z, h, g = gibbs_moves.sweep(target, z, h, g, torch.tensor([beta], dtype=torch.float64), 4, generator)
    index = {tuple(labelling): k for k, labelling in enumerate(labellings)}
    counts = torch.zeros(len(labellings))
    for row in z[0].tolist():
        counts[index[tuple(row)]] += 1
    expected = probs * draws
    kept = expected > 5  # chi-square's validity: pool the rare cells
    rare = [] if kept.all() else [None]  # one pooled cell, if any
    observed = torch.cat([counts[kept], *(counts[~kept].sum()[None] for _ in rare)])
    predicted = torch.cat([expected[kept], *(expected[~kept].sum()[None] for _ in rare)])
    assert scipy.stats.chisquare(observed.numpy(), predicted.numpy()).pvalue > 1e-3
    # and every head row's counts under the exact head marginal of p_beta
    head_marginal = torch.zeros(crf.channels, N, N, dtype=torch.float64)
    for weight, rows in zip(probs, conditionals):
        for key, (values, row) in rows.items():
            if key[0] == "h":
                head_marginal[key[1], key[2], values] += weight * row
    for c in range(crf.channels):
        for i in range(N):
            legal = head_marginal[c, i] > 0
            if legal.sum() > 1:
                observed = torch.bincount(h[0, :, c, i], minlength=N)[legal].double()
                assert (
                    scipy.stats.chisquare(observed.numpy(), (head_marginal[c, i, legal] * draws).numpy()).pvalue > 1e-4
                )


# ---- bad input ------------------------------------------------------------------------------


def test_a_crf_it_cannot_compile_is_refused_by_name():
    memory = graphs.CRF(vocab_size=5, labels=2, global_labels=4, global_memory="product_key")
    with pytest.raises(ValueError, match="TemperedSMC cannot compile"):
        TemperedSMC(memory)

    class NoPotential(graphs.Factor):
        pass

    crf = graphs.CRF(vocab_size=5, labels=2, factors=[NoPotential()])
    with pytest.raises(ValueError, match="nopotential0.*log_potential"):
        TemperedSMC(crf)
    with pytest.raises(TypeError, match="crf must be a graphs.CRF"):
        TemperedSMC(object())


def test_a_proposal_of_the_wrong_shape_or_values_is_refused():
    crf, tokens, mask = make_case("global")
    exact = inference.Exact(crf)(tokens, mask)
    engine = TemperedSMC(crf, num_particles=4, replicates=2, seed=0)
    wrong = inference.Posterior(z=exact.z[:, :2], h=exact.h, g=exact.g)
    with pytest.raises(ValueError, match=r"proposal.z must be a tensor of shape \[2, 4, 3\]"):
        engine.run(tokens, mask, proposal=wrong)
    missing = inference.Posterior(z=exact.z, h=exact.h, g=None)
    with pytest.raises(ValueError, match="proposal.g"):
        engine.run(tokens, mask, proposal=missing)
    poisoned = inference.Posterior(z=exact.z.clone().fill_(math.nan), h=exact.h, g=exact.g)
    with pytest.raises(ValueError, match="proposal.z must hold finite"):
        engine.run(tokens, mask, proposal=poisoned)
    with pytest.raises(TypeError, match="proposal must be an inference.Posterior"):
        engine.run(tokens, mask, proposal=exact.z)


def test_non_finite_weights_are_refused():
    class Overflow(graphs.Factor):
        def log_potential(self, z, tokens, mask):
            return torch.full((z.shape[0],), math.inf, dtype=torch.float64)

    crf = graphs.CRF(vocab_size=5, labels=2, factors=[Overflow()]).double()
    tokens = torch.tensor([[1, 2]])
    exact_free = inference.Posterior(z=torch.full((1, 2, 2), 0.5), h=torch.tensor([[[[0.0, 1.0], [1.0, 0.0]]]]))
    with pytest.raises(ValueError, match="non-finite importance weights"):
        TemperedSMC(crf, num_particles=4, replicates=2).run(tokens, proposal=exact_free)


@pytest.mark.parametrize(
    "name,value,error",
    [
        ("num_particles", 0, ValueError),
        ("replicates", 1.5, TypeError),
        ("target_ess", 1.0, ValueError),
        ("resample", "best", ValueError),
        ("resample_threshold", 0.0, ValueError),
        ("rounds", 0, ValueError),
        ("proposal_floor", -0.1, ValueError),
        ("pilot", "yes", TypeError),
    ],
)
def test_bad_arguments_are_named(name, value, error):
    crf = graphs.CRF(vocab_size=5, labels=2)
    with pytest.raises(error, match=name):
        TemperedSMC(crf, **{name: value})


def test_a_user_factor_without_expectation_needs_an_explicit_proposal():
    class Bonus(graphs.Factor):
        def log_potential(self, z, tokens, mask):
            return (z[:, 0] == z[:, 1]).double()

    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=5, labels=2, factors=[Bonus()]).double()
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="default proposal, MeanField, cannot compile"):
        TemperedSMC(crf, num_particles=8, replicates=2).run(tokens)
    uniform = inference.Posterior(z=torch.full((1, 3, 2), 0.5), h=torch.full((1, 1, 3, 3), 0.5))
    result = TemperedSMC(crf, num_particles=64, replicates=16, seed=0).run(tokens, proposal=uniform)
    error = (result.log_partition - inference.Exact(crf).log_partition(tokens)).abs()
    assert (error < 4 * result.standard_error).all() and (result.standard_error < 0.05).all()
