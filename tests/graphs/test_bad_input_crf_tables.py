"""The CRF's table methods refuse bad arguments by name: ``unary_table`` took unchecked ids
(float or out-of-range ids failed with an IndexError, -1 read the last row, uint8 ids were
read as a bool mask, an int mask was accepted), ``node_mask(None)`` raised AttributeError,
and ``memory_scores`` raised AttributeError on a dense CRF, a bare matmul error for a query
of the wrong width and returned NaN for a NaN query."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs

VOCAB, LABELS = 5, 4


def token_crf():
    return graphs.CRF(vocab_size=VOCAB, labels=LABELS, topology="clusters(1)")


def memory_crf():
    return graphs.CRF(vocab_size=VOCAB, labels=LABELS, global_labels=4, global_memory="product_key")


@given(bad=st.one_of(st.integers(-(2**62), -1), st.integers(VOCAB, 2**62)), at=st.integers(0, 2))
def test_an_id_out_of_range_is_refused_by_name(bad, at):
    tokens = torch.tensor([[0, 1, 2]])
    tokens[0, at] = bad
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 5\) \(vocab_size\)"):
        token_crf().unary_table(tokens, torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize(
    ("tokens", "mask", "words"),
    [
        (torch.tensor([[0.0, 1.0]]), None, "tokens must have an integer dtype"),
        (torch.tensor([[True, False]]), None, "tokens must have an integer dtype"),
        ([[0, 1]], None, "tokens must be a torch.Tensor"),
        (torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.long), "mask must be a torch.bool tensor"),
    ],
)
def test_ids_or_a_mask_of_a_wrong_type_are_refused_by_name(tokens, mask, words):
    mask = torch.ones(1, 2, dtype=torch.bool) if mask is None else mask
    with pytest.raises(TypeError, match=words):
        token_crf().unary_table(tokens, mask)


def test_uint8_ids_are_read_as_ids_not_as_a_mask():
    crf = graphs.CRF(vocab_size=VOCAB, labels=LABELS)
    tokens = torch.tensor([[0, 1, 1, 0, 4]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    assert torch.equal(crf.unary_table(tokens.to(torch.uint8), mask), crf.unary_table(tokens, mask))


def test_padding_reads_zero_whatever_id_it_holds_and_a_padding_row_is_allowed():
    crf = token_crf()
    tokens, mask = torch.tensor([[1, -100], [-1, 99]]), torch.tensor([[True, False], [False, False]])
    table = crf.unary_table(tokens, mask)
    assert table.shape == (2, 3, LABELS)
    assert torch.equal(table[0, 0], crf.unary[1].detach()) and not table[0, 1:].any() and not table[1].any()


@pytest.mark.parametrize(
    ("embeddings", "mask", "error", "words"),
    [
        (torch.zeros(1, 2, 3, dtype=torch.long), None, TypeError, "embeddings must be a floating torch.Tensor"),
        (torch.zeros(1, 2, 4), None, ValueError, r"embeddings must have shape \[batch, length, 3\]"),
        (torch.zeros(1, 2, 3), torch.ones(1, 2, dtype=torch.long), TypeError, "mask must be a torch.bool tensor"),
        (torch.full((1, 2, 3), float("nan")), None, ValueError, "embeddings contains NaN or Inf"),
    ],
)
def test_the_embedding_table_refuses_bad_embeddings_by_name(embeddings, mask, error, words):
    crf = graphs.CRF(embedding_size=3, labels=LABELS)
    mask = torch.ones(1, 2, dtype=torch.bool) if mask is None else mask
    with pytest.raises(error, match=words):
        crf.embedding_table(embeddings, mask)


@pytest.mark.parametrize("mask", [None, torch.ones(1, 3, dtype=torch.long), torch.ones(3, dtype=torch.bool), [[True]]])
def test_node_mask_refuses_what_is_not_a_bool_mask_by_name(mask):
    with pytest.raises(TypeError, match=r"mask must be a torch.bool tensor \[batch, length\]"):
        token_crf().node_mask(mask)


def test_memory_scores_of_a_dense_crf_are_refused_by_name():
    with pytest.raises(ValueError, match="memory_scores needs a product-key memory"):
        graphs.CRF(vocab_size=VOCAB, labels=LABELS).memory_scores(torch.zeros(LABELS))


@given(width=st.integers(0, 12).filter(lambda w: w != LABELS), batch=st.lists(st.integers(1, 3), max_size=2))
def test_a_query_of_a_wrong_width_is_refused_by_name(width, batch):
    with pytest.raises(ValueError, match=r"query must have shape \[\.\.\., 4\] \(labels\)"):
        memory_crf().memory_scores(torch.zeros(*batch, width))


@pytest.mark.parametrize(
    "query", [torch.zeros(LABELS, dtype=torch.long), torch.zeros(LABELS, dtype=torch.float64), [0.0] * LABELS]
)
def test_a_query_of_a_wrong_type_is_refused_by_name(query):
    with pytest.raises(TypeError, match="query must"):
        memory_crf().memory_scores(query)


@given(value=st.sampled_from([float("nan"), float("inf"), -float("inf")]), at=st.integers(0, LABELS - 1))
def test_a_non_finite_query_is_refused_by_name(value, at):
    query = torch.zeros(2, LABELS)
    query[1, at] = value
    with pytest.raises(ValueError, match="query contains NaN or Inf"):
        memory_crf().memory_scores(query)


def test_a_good_query_scores_both_halves():
    crf = memory_crf()
    first, second = crf.memory_scores(torch.ones(3, LABELS))
    assert first.shape == second.shape == (3, 2) and first.isfinite().all() and second.isfinite().all()
