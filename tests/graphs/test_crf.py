import itertools
import math

import pyro
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pyro import poutine
from pyro.infer import TraceEnum_ELBO, config_enumerate

import graphs
import inference
from tests import oracles
from tests.strategies import tiny_crfs


def make_crf(**kwargs):
    torch.manual_seed(0)
    args = dict(vocab_size=7, labels=3, channels=2, rank=2, global_labels=0, topology="full")
    args.update(kwargs)
    return graphs.CRF(**args)


def test_parameter_names_and_shapes():
    crf = make_crf(global_labels=4, gamma=3)
    assert crf.unary.shape == (7, 3)
    assert crf.ternary_u.shape == crf.ternary_v.shape == (8, 2, 3, 2)
    assert crf.binary.shape == (4, 3)
    assert make_crf().binary is None
    assert make_crf(topology="star()").ternary_u.shape[0] == 9  # + one group for virtual arcs
    assert make_crf(gamma=0).num_groups == 2


@pytest.mark.parametrize("gamma", [0, 1, 3, 5])
def test_distance_groups_match_definition(gamma):
    n = 9
    groups = graphs.distance_groups(n, gamma, extra_nodes=2)
    for i, j in itertools.product(range(n + 2), repeat=2):
        if i != j:
            assert groups[i, j] == oracles.group_of(i, j, n, gamma), (i, j)
    token_groups = {groups[i, j].item() for i in range(n) for j in range(n) if i != j}
    assert token_groups == set(range(2 * (gamma + 1)))


@pytest.mark.parametrize("topo", ["full", "causal", "window(2)", "star()", "clusters(2)", "segments(2)"])
def test_ternary_table_is_the_potential_per_arc(topo):
    crf = make_crf(topology=topo)
    n = 5
    table = crf.ternary_table(n)
    N = crf.topology.num_nodes(n)
    assert table.shape == (2, N, N, 3, 3)
    T = torch.einsum("kcar,kcbr->kcab", crf.ternary_u, crf.ternary_v).detach()
    allowed = crf.topology.mask(n)
    for c, i, j in itertools.product(range(2), range(N), range(N)):
        if allowed[i, j]:
            torch.testing.assert_close(table[c, i, j].detach(), T[oracles.group_of(i, j, n, crf.gamma), c])
        else:
            assert torch.isneginf(table[c, i, j]).all()
    assert torch.isneginf(table.diagonal(dim1=1, dim2=2)).all()


@given(data=tiny_crfs(), seed=st.integers(0, 1000))
def test_log_potential_matches_independent_scorer(data, seed):
    crf, tokens, mask = data
    B, n = tokens.shape
    N = crf.topology.num_nodes(n)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randint(0, crf.labels, (B, N), generator=gen)
    h = torch.randint(0, N, (B, crf.channels, N), generator=gen)
    g = torch.randint(0, crf.global_labels, (B, n), generator=gen) if crf.global_labels else None
    got = crf.log_potential(tokens, z, h, g, mask)
    for b in range(B):
        expected = oracles.log_potential(
            crf,
            tokens[b].tolist(),
            mask[b].tolist(),
            z[b].tolist(),
            h[b].tolist(),
            None if g is None else g[b].tolist(),
        )
        if math.isinf(expected):
            assert torch.isneginf(got[b])
        else:
            assert got[b].item() == pytest.approx(expected, abs=1e-4)


def test_model_runs_under_pyro_handlers_and_trace_enum_elbo_gives_log_z():
    crf = make_crf(labels=2, global_labels=2, topology="window(1) | star()")
    tokens = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    trace = poutine.trace(crf.model).get_trace(tokens, mask)
    names = [name for name, site in trace.nodes.items() if site["type"] == "sample"]
    assert {"z_0", "z_3", "g_0", "h_0_0", "h_1_3", "unary_0", "ternary_0_0_1"} <= set(names)
    assert "g_3" not in names  # the relay has no global variable
    assert not trace.nodes["h_0_0"]["is_observed"] and trace.nodes["unary_0"]["is_observed"]
    elbo = TraceEnum_ELBO(max_plate_nesting=1)
    with torch.no_grad():
        log_z = -elbo.loss(config_enumerate(crf.model), lambda *a, **k: None, tokens, mask)
    expected = sum(oracles.brute_force(crf, tokens[b].tolist(), mask[b].tolist())[0] for b in range(2))
    assert log_z == pytest.approx(expected, abs=1e-4)


def test_padded_tokens_have_no_factors_and_are_never_heads():
    crf = make_crf(labels=2)
    tokens = torch.tensor([[1, 2, 3]])
    mask = torch.tensor([[True, True, False]])
    trace = poutine.trace(crf.model).get_trace(tokens, mask)
    probs = trace.nodes["h_0_0"]["fn"].probs
    assert probs[0, 2] == 0  # the padded position cannot be chosen
    assert trace.nodes["unary_2"]["fn"].log_prob(trace.nodes["unary_2"]["value"]).item() == 0
    assert "ternary_0_0_2" not in trace.nodes and "ternary_0_2_0" not in trace.nodes


# ---- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,mask,error,match",
    [
        (torch.tensor([[1.0, 2.0]]), None, TypeError, "integer dtype"),
        ([[1, 2]], None, TypeError, "torch.Tensor"),
        (torch.tensor([1, 2]), None, ValueError, r"shape \[batch, length\]"),
        (torch.zeros(1, 0, dtype=torch.long), None, ValueError, "non-empty"),
        (torch.tensor([[1, 7]]), None, ValueError, r"\[0, 7\) \(vocab_size\); found 7"),
        (torch.tensor([[-1, 2]]), None, ValueError, "found -1"),
        (
            torch.tensor([[1, 2], [3, 4]]),
            torch.tensor([[True, True], [False, False]]),
            ValueError,
            r"rows \[1\]",
        ),
        (torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), TypeError, "torch.bool"),
        (torch.tensor([[1, 2]]), torch.tensor([[True, True, True]]), ValueError, "mask shape"),
    ],
)
def test_bad_inputs_raise_named_errors(tokens, mask, error, match):
    crf = make_crf()
    with pytest.raises(error, match=match):
        crf.check_inputs(tokens, mask)
    with pytest.raises(error, match=match):
        poutine.trace(crf.model).get_trace(tokens, mask)


def test_padded_positions_may_hold_any_id():
    crf = make_crf()
    tokens, mask = crf.check_inputs(torch.tensor([[1, -100]]), torch.tensor([[True, False]]))
    assert tokens.tolist() == [[1, 0]]


@pytest.mark.parametrize("name", ["unary", "ternary_u", "ternary_v", "binary"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_potentials_are_refused(name, value):
    crf = make_crf(global_labels=2)
    with torch.no_grad():
        getattr(crf, name).view(-1)[0] = value
    with pytest.raises(ValueError, match=f"'{name}' contains NaN or Inf"):
        poutine.trace(crf.model).get_trace(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        crf.ternary_table(3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(labels=0), "labels must be an integer >= 1"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(channels=0), "channels"),
        (dict(rank=0), "rank"),
        (dict(global_labels=-1), "global_labels must be an integer >= 0"),
        (dict(gamma=-1), "gamma"),
        (dict(topology="spiral"), "unknown topology name 'spiral'"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_crf(**kwargs)


@pytest.mark.parametrize("name,value", [("labels", 2.5), ("labels", "3"), ("channels", None), ("rank", True)])
def test_sizes_of_a_wrong_type_are_type_errors(name, value):
    with pytest.raises(TypeError, match=f"{name} must be an integer"):
        make_crf(**{name: value})


# the limits restated here on purpose (an oracle independent of graphs.crf.LIMITS)
SIZE_LIMITS = {
    "vocab_size": 2**24,
    "labels": 2**16,
    "channels": 2**10,
    "rank": 2**14,
    "global_labels": 2**20,
    "gamma": 2**12,
    "ternary_blocks": 2**10,
}


@pytest.mark.parametrize("name", sorted(SIZE_LIMITS))
@pytest.mark.parametrize("excess", [1, 10**12])
def test_sizes_above_their_limit_are_refused_before_allocation(name, excess):
    # 10**12 reached the allocator (RuntimeError: DefaultCPUAllocator)
    value = SIZE_LIMITS[name] + excess if excess == 1 else excess
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= \d+ and <= {SIZE_LIMITS[name]} \(the limit\)"):
        make_crf(**{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab_size=2**24, labels=2**10),
        dict(labels=2**12, rank=2**12, channels=8),
        dict(global_labels=2**20, labels=2**12),
    ],
)
def test_sizes_within_limits_but_absurd_together_are_refused(kwargs):
    with pytest.raises(ValueError, match=r"parameters, more than the limit 2,147,483,648 \(2\*\*31\)"):
        make_crf(**kwargs)


def test_log_potential_validates_assignments():
    crf = make_crf(global_labels=2)
    tokens = torch.tensor([[1, 2]])
    z, h, g = (
        torch.zeros(1, 2, dtype=torch.long),
        torch.tensor([[[1, 0], [1, 0]]]),
        torch.zeros(1, 2, dtype=torch.long),
    )
    with pytest.raises(ValueError, match="z must have shape"):
        crf.log_potential(tokens, z[:, :1], h, g)
    with pytest.raises(ValueError, match=r"z values must lie in \[0, 3\)"):
        crf.log_potential(tokens, z + 5, h, g)
    with pytest.raises(ValueError, match="g is required"):
        crf.log_potential(tokens, z, h)
    with pytest.raises(TypeError, match="h must be an integer tensor"):
        crf.log_potential(tokens, z, h.float(), g)
    assert torch.isneginf(crf.log_potential(tokens, z, torch.zeros(1, 2, 2, dtype=torch.long), g)).all()


def test_model_is_device_and_dtype_agnostic_float64():
    crf = make_crf(labels=2).double()
    tokens = torch.tensor([[1, 2, 3]])
    trace = poutine.trace(config_enumerate(crf.model)).get_trace(tokens)
    assert trace.nodes["unary_0"]["fn"].log_prob(trace.nodes["unary_0"]["value"]).dtype == torch.float64
    pyro.clear_param_store()


SIDES = {  # each form's dependent-side and head-side parameters: scaling both by s scales T by s^2
    "low_rank": ("ternary_u", "ternary_v"),
    "cp": ("cp_dependent", "cp_head"),
    "tucker": ("tucker_dependent", "tucker_head"),
    "shared": ("shared_u", "shared_v"),
}


def ternary_by_hand(crf, divide: float) -> torch.Tensor:
    """``T [K, C, d, d]`` in float64 from the raw parameters, the side parameters divided by
    ``divide`` (so T / divide^2, the bias / divide^2 too), each form's formula restated here."""
    p = {name: param.detach().double() for name, param in crf.named_parameters()}
    for name in SIDES[crf.ternary_form]:
        p[name] = p[name] / divide
    if crf.ternary_form == "low_rank":
        return torch.einsum("kcar,kcbr->kcab", p["ternary_u"], p["ternary_v"])
    if crf.ternary_form == "cp":
        return torch.einsum("kcp,kap,kbp->kcab", p["cp_channel"], p["cp_dependent"], p["cp_head"])
    if crf.ternary_form == "tucker":
        return torch.einsum("mkap,mkcpq,mkbq->kcab", p["tucker_dependent"], p["tucker_core"], p["tucker_head"])
    bias = p["shared_bias"][:, :, None, None] / divide / divide
    return torch.einsum("cap,cbp->cab", p["shared_u"], p["shared_v"])[None] + bias


@settings(max_examples=60, deadline=None)
@given(
    form=st.sampled_from(sorted(SIDES)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    excess=st.floats(-6.0, 3.0),  # log10 of the largest |T| over the dtype's largest finite number
    kernel=st.sampled_from(["naive", "fused"]),
    seed=st.integers(0, 2**16),
)
def test_ternary_potentials_beyond_the_dtype_are_refused_by_name_and_those_well_within_run(
    form, dtype, excess, kernel, seed
):
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=2, ternary_form=form, ternary_blocks=2).to(dtype)
    if form == "shared":
        with torch.no_grad():
            crf.shared_bias.normal_()
    largest = torch.finfo(dtype).max
    unscaled = math.log10(ternary_by_hand(crf, 1.0).abs().max().item())
    scale = 10 ** ((excess + math.log10(largest) - unscaled) / 2)
    with torch.no_grad():
        for name in SIDES[form]:
            getattr(crf, name).mul_(scale)
    # log10 of the largest |T| of the scaled parameters, computed without overflowing float64
    found = math.log10(ternary_by_hand(crf, scale).abs().max().item()) + 2 * math.log10(scale)
    run = inference.MeanField(crf, iterations=2, kernel=kernel)
    tokens = torch.tensor([[1, 3, 2, 4]])
    if found > math.log10(largest):
        with pytest.raises(ValueError, match=r"ternary potentials of group \d+, channel \d+ may reach .*may overflow"):
            run(tokens)
    elif found < math.log10(largest) - 3:
        with torch.no_grad():
            post = run(tokens)
        assert torch.isfinite(post.z).all() and torch.isfinite(post.elbo).all()
