"""The kernel choice (inference.mean_field.kernels.choice): the documented table, training as
an argument, flex or fused by device and dtype, the shared form kept materialised, and the
precision that follows the score bound (computed here in numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field import engine as mean_field
from inference.mean_field.kernels import choice as kernel_choice
from inference.mean_field.kernels import head_kernels
from inference.mean_field.options import MeanFieldOptions
from tests.builders import grouped_crf, shared_crf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_float64_on_cuda_runs_the_fused_kernel(monkeypatch):
    """The Triton kernel is not tested in float64: the engine routes float64 on CUDA to the
    fused kernel (its choice, read without a GPU)."""
    query = torch.zeros(1, 2, 1, 1, 1, dtype=torch.float64)
    cuda_query = type("OnCuda", (), {"device": torch.device("cuda"), "dtype": torch.float64})()
    assert kernel_choice._flex_or_fused("flex", cuda_query, None) == "fused"
    cuda_float32 = type("OnCuda", (), {"device": torch.device("cuda"), "dtype": torch.float32})()
    assert kernel_choice._flex_or_fused("flex", cuda_float32, torch.float64) == "fused"
    assert kernel_choice._flex_or_fused("flex", cuda_float32, None) == "flex"
    assert kernel_choice._flex_or_fused("fused", query, None) == "fused"


def test_auto_picks_flex_on_cuda_and_flex_refuses_what_it_cannot_do():
    crf = graphs.CRF(vocab_size=9, labels=4, channels=2, rank=3)
    auto = mean_field.MeanField(crf)
    assert auto.resolved_kernel(10, torch.device("cuda")) == "flex"  # a device name: no GPU needed
    assert auto.resolved_kernel(10, torch.device("cpu")) == "naive"
    assert mean_field.MeanField(crf, damping=(0.0, 0.5)).resolved_kernel(10, torch.device("cuda")) == "naive"
    with pytest.raises(ValueError, match="kernel='flex' supports no"):
        mean_field.MeanField(crf, kernel="flex", damping=0.5)
    with pytest.raises(ValueError, match="kernel='flex' cannot apply dropout"):
        mean_field.MeanField(crf, kernel="flex", dropout=0.1).train().resolved_kernel(10, torch.device("cuda"))


def test_auto_kernel_keeps_the_shared_form_materialised_up_to_512_nodes():
    cpu = torch.device("cpu")
    if not head_kernels.fused_available(cpu):
        pytest.skip("no CPU flash kernel: auto is always naive here")
    shared = inference.MeanField(shared_crf())
    grouped = inference.MeanField(graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2))
    assert [shared.resolved_kernel(n, cpu) for n in (128, 512, 513)] == ["naive", "naive", "fused"]
    assert [grouped.resolved_kernel(n, cpu) for n in (128, 129)] == ["naive", "fused"]


CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU is needed to choose


# (options, shared ternary form, n, device, training) -> kernel, from the documented rules:
# an explicit kernel is kept; auto is naive whenever the heads need materialising (head damping
# or step size, the sequential schedule, an adaptive span, dropout while training), flex on
# CUDA, and on the CPU fused from 129 nodes (513 with the shared ternary form), else naive.
TABLE = [
    (dict(kernel="naive"), False, 1000, CUDA, True, "naive"),
    (dict(kernel="fused"), False, 5, CPU, True, "fused"),
    (dict(kernel="fused", dropout=0.1), False, 5, CPU, False, "fused"),
    (dict(kernel="flex", dropout=0.1), False, 5, CUDA, False, "flex"),
    (dict(), False, 10, CUDA, True, "flex"),
    (dict(), True, 10, CUDA, False, "flex"),
    (dict(), False, 128, CPU, False, "naive"),
    (dict(), False, 129, CPU, False, "fused"),
    (dict(), True, 128, CPU, False, "naive"),
    (dict(), True, 512, CPU, False, "naive"),
    (dict(), True, 513, CPU, False, "fused"),
    (dict(dropout=0.1), False, 1000, CPU, False, "fused"),
    (dict(dropout=0.1), False, 1000, CPU, True, "naive"),
    (dict(dropout=0.1), False, 1000, CUDA, True, "naive"),
    (dict(dropout=0.1), False, 1000, CUDA, False, "flex"),
    (dict(damping=(0.0, 0.5)), False, 1000, CUDA, False, "naive"),
    (dict(damping=(0.5, 0.0)), False, 1000, CUDA, False, "flex"),  # label damping: any kernel
    (dict(step_size=(1.0, 0.5)), False, 1000, CPU, False, "naive"),
    (dict(step_size=(0.5, 1.0)), False, 1000, CPU, False, "fused"),
    (dict(schedule="sequential"), False, 1000, CUDA, False, "naive"),
    (dict(adaptive_span=True), False, 1000, CUDA, False, "naive"),
]


@pytest.mark.parametrize(("settings", "shared", "n", "device", "training", "expected"), TABLE)
def test_the_kernel_choice_follows_the_documented_table(settings, shared, n, device, training, expected):
    if expected == "fused" and device == CPU and not head_kernels.fused_available(CPU):
        pytest.skip("no CPU flash kernel: auto never picks fused here")
    crf = shared_crf() if shared else grouped_crf()
    options = MeanFieldOptions(**settings)
    assert kernel_choice.resolved_kernel(options, crf, n, device, training) == expected


def every_other_token(n: int) -> torch.Tensor:
    return ~torch.eye(n, dtype=torch.bool)


@pytest.mark.parametrize(
    "topology", ["star(wrap=True)", "window(1) | star(wrap=True)", graphs.topology.from_callable(every_other_token)]
)
def test_a_topology_of_the_sentence_length_follows_the_same_table(topology):
    """Its rows' own token tables are read by every kernel: nothing refused by name, and auto
    picks as on any other topology."""
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2, topology=topology)
    assert crf.topology.row_tokens
    for settings, shared, n, device, training, expected in TABLE:
        if shared or (expected == "fused" and device == CPU and not head_kernels.fused_available(CPU)):
            continue
        assert kernel_choice.resolved_kernel(MeanFieldOptions(**settings), crf, n, device, training) == expected


def test_training_is_an_argument_of_the_choice_not_a_frozen_setting():
    """The same options refuse dropout on fused heads while training and accept it in eval."""
    options = MeanFieldOptions(kernel="fused", dropout=0.1)
    assert kernel_choice.resolved_kernel(options, grouped_crf(), 5, CPU, False) == "fused"
    with pytest.raises(ValueError, match="kernel='fused' cannot apply dropout"):
        kernel_choice.resolved_kernel(options, grouped_crf(), 5, CPU, True)
    engine = inference.MeanField(grouped_crf(), kernel="fused", dropout=0.1)
    assert engine.eval().resolved_kernel(5, CPU) == "fused"
    with pytest.raises(ValueError, match="cannot apply dropout"):
        engine.train().resolved_kernel(5, CPU)


def numpy_score_bound(crf) -> float:
    """max over groups and channels of max_a |U_a| max_b |V_b|, in numpy."""
    u, v, _ = (None if t is None else t.detach().numpy() for t in crf.projection_tables())
    return float((np.linalg.norm(u, axis=-1).max(-1) * np.linalg.norm(v, axis=-1).max(-1)).max())


@given(st.floats(0.05, 20.0))
def test_the_precision_follows_the_score_bound_computed_in_numpy(scale):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=3)
    with torch.no_grad():
        for p in (crf.ternary_u, crf.ternary_v):
            p.mul_(6.0)
    bound = numpy_score_bound(crf)
    if abs(abs(scale) * bound - 512) < 1e-3 * 512:
        return  # too close to the limit for float32 rounding to agree
    expected = torch.float64 if scale * bound > 512 else None
    assert kernel_choice.fused_compute_dtype(crf, kernel_choice.ScoreBound(), scale) == expected
