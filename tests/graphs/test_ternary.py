"""The shared ternary form as data: its tensor, per-group factors and parameters, written
here from U, V and the bias directly (graphs.ternary)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
from tests.builders import shared_crf

torch.set_num_threads(1)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 3),
    st.sampled_from(["full", "full | root()"]),
    st.integers(0, 2**16),
)
def test_tensor_and_factors_are_u_v_plus_the_group_bias(channels, labels, rank, gamma, topology, seed):
    crf = shared_crf(labels, channels, rank, gamma, topology, seed=seed)
    K = 2 * (gamma + 1) + (1 if "root" in topology else 0)
    U, V, bias = crf.shared_u, crf.shared_v, crf.shared_bias
    assert U.shape == V.shape == (channels, labels, rank) and bias.shape == (K, channels)
    expected = torch.einsum("car,cbr->cab", U, V)[None] + bias[:, :, None, None]
    torch.testing.assert_close(crf.ternary_tensor(), expected, atol=1e-12, rtol=0)
    u, v = crf.ternary_u, crf.ternary_v  # the per-group factors every engine may read
    assert u.shape == v.shape == (K, channels, labels, rank + 1)
    torch.testing.assert_close(torch.einsum("kcar,kcbr->kcab", u, v), expected, atol=1e-12, rtol=0)
    assert crf.ternary_parameter_count() == 2 * channels * labels * rank + K * channels
    tables_u, tables_v, tables_bias = crf.projection_tables()
    assert tables_u.shape[0] == tables_v.shape[0] == 1 and tables_bias is bias


def test_the_bias_starts_at_zero_and_forms_are_named():
    crf = graphs.CRF(vocab_size=3, labels=4, channels=2, rank=2, ternary_form="shared")
    assert torch.equal(crf.shared_bias, torch.zeros(8, 2))
    assert "shared" in graphs.TERNARY_FORMS and "ternary_form='shared'" in repr(crf)
    with pytest.raises(ValueError, match="ternary_form must be one of .*'shared'"):
        graphs.CRF(vocab_size=3, labels=4, ternary_form="shared_bias")
