"""The Posterior contract: docs/api.md's table (field by field, what each engine returns and
whether it is differentiable) read from the page and checked against the engines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import graphs
import inference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
ENGINES = {
    "Exact": lambda crf: inference.Exact(crf),
    "MeanField": lambda crf: inference.MeanField(crf, iterations=2),
    "Gibbs": lambda crf: inference.Gibbs(crf, num_samples=50, num_warmup=10, num_chains=2),
}
CELLS = ("value", "differentiable", "None")


def contract_table() -> dict[str, dict[str, str]]:
    """``{engine: {field: cell}}`` from the table between the page's contract markers."""
    text = PAGE.read_text()
    block = text.split("<!-- posterior-contract -->")[1].split("<!-- /posterior-contract -->")[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
    header, body = rows[0], rows[2:]
    engines = header[2:]
    table = {engine: {} for engine in engines}
    for row in body:
        field = re.fullmatch(r"`(\w+)`", row[0]).group(1)
        for engine, cell in zip(engines, row[2:]):
            table[engine][field] = cell
    return table


def test_the_table_names_every_engine_and_only_the_three_kinds_of_cell():
    table = contract_table()
    assert set(table) == set(ENGINES)
    fields = {field for engine in table.values() for field in engine}
    assert fields == {"z", "h", "g", "log_partition", "elbo", "logits"}
    assert all(cell in CELLS for engine in table.values() for cell in engine.values())


def check_field(engine: str, field: str, cell: str, post, crf) -> None:
    value = getattr(post, field)
    where = f"{engine}(crf).{field} with a {crf.unary.dtype} CRF"
    if cell == "None":
        assert value is None, where
        return
    assert isinstance(value, torch.Tensor), where
    assert value.dtype == crf.unary.dtype, (where, value.dtype)
    assert torch.isfinite(value).all(), where
    if cell == "value":
        assert not value.requires_grad, where
        return
    assert value.requires_grad, where
    weights = torch.rand(value.shape, generator=torch.Generator().manual_seed(0), dtype=value.dtype)
    total = (value * weights).sum()  # a plain sum of marginals is 1 per row: no gradient to see
    grads = torch.autograd.grad(total, list(crf.parameters()), allow_unused=True, retain_graph=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads), where


def tiny_crf(dtype):
    torch.manual_seed(0)
    return graphs.CRF(vocab_size=6, labels=2, channels=1, rank=2, global_labels=2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("engine", ["Exact", "MeanField", "Gibbs"])
def test_every_engine_returns_what_the_table_says(engine, dtype):
    if engine == "Gibbs" and dtype == torch.float64:
        pytest.skip("one Gibbs run (JAX compiles per call): float32, the case where it returned float64")
    crf = tiny_crf(dtype)
    tokens = torch.tensor([[1, 4, 2], [5, 3, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    post = ENGINES[engine](crf)(tokens, mask)
    for field, cell in contract_table()[engine].items():
        check_field(engine, field, cell, post, crf)


def test_exact_log_partition_from_the_call_has_the_gradient_of_the_method():
    """``Exact(crf)(tokens).log_partition`` is the method's float64 log Z cast to the CRF's
    dtype, and its gradient is the method's (the marginals' expected sufficient statistics)."""
    crf = tiny_crf(torch.float64)
    tokens = torch.tensor([[1, 4, 2]])
    from_call = inference.Exact(crf)(tokens).log_partition
    (call_grad,) = torch.autograd.grad(from_call.sum(), [crf.unary])
    from_method = inference.Exact(crf).log_partition(tokens)
    (method_grad,) = torch.autograd.grad(from_method.sum(), [crf.unary])
    torch.testing.assert_close(from_call, from_method, rtol=0, atol=0)
    torch.testing.assert_close(call_grad, method_grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # no graph asked for: none kept
        assert not inference.Exact(crf)(tokens).log_partition.requires_grad


@pytest.mark.parametrize("engine", ["Exact", "MeanField"])
@pytest.mark.parametrize("crf_dtype,input_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_embeddings_of_another_dtype_give_the_crfs_dtype(engine, crf_dtype, input_dtype):
    """Embeddings are read in the CRF's dtype: the Posterior keeps it, and the answer is the
    one for the embeddings cast to it."""
    torch.manual_seed(0)
    crf = graphs.CRF(embedding_size=3, labels=2, channels=1, rank=2).to(crf_dtype)
    x = torch.randn(2, 3, 3, dtype=input_dtype)
    run = ENGINES[engine](crf)
    post = run(embeddings=x)
    assert post.z.dtype == crf_dtype
    torch.testing.assert_close(post.z, run(embeddings=x.to(crf_dtype)).z, rtol=0, atol=0)
