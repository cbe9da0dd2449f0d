"""``SMC.filter``'s sizes and what ``init`` returns, refused by name: the records of a run
(the ESS ``[T, B]``, the ancestors ``[T, B, N]``) are allocated before its first step, so a
huge ``num_steps`` asked for tens of gigabytes, and an ``init`` that returned another batch
than ``batch_size`` ran silently with its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import inference
from inference.smc.filter import MAX_RECORDS

pytestmark = pytest.mark.usefixtures("one_thread")


def never_called(t, particles):
    raise AssertionError("the run started: its records were allocated")


@given(
    num_particles=st.integers(1, 64),
    batch_size=st.integers(1, 64),
    record_ancestors=st.booleans(),
    excess=st.integers(1, 2**20),
)
def test_records_beyond_the_limit_are_refused_before_anything_is_allocated(
    num_particles, batch_size, record_ancestors, excess
):
    per_step = batch_size * (num_particles if record_ancestors else 1)
    num_steps = MAX_RECORDS // per_step + excess
    smc = inference.SMC(num_particles, record_ancestors=record_ancestors)
    words = "the ancestors" if record_ancestors else "the ESS"
    with pytest.raises(ValueError, match=rf"{words} .* exceeds the limit {MAX_RECORDS}"):
        smc.filter(lambda B: torch.zeros(B, num_particles), never_called, num_steps=num_steps, batch_size=batch_size)


def test_the_refusal_of_recorded_ancestors_names_the_way_out():
    with pytest.raises(ValueError, match="record_ancestors=False keeps no"):
        inference.SMC(4).filter(lambda B: torch.zeros(B, 4), never_called, num_steps=MAX_RECORDS // 4 + 1, batch_size=1)


def test_never_resampling_records_no_ancestors_and_is_limited_by_its_ess_record():
    smc = inference.SMC(4, ess_threshold=0)
    smc.filter(lambda B: torch.zeros(B, 4), lambda t, p: (p, torch.zeros(1, 4)), num_steps=3)  # runs
    with pytest.raises(ValueError, match=r"num_steps x batch_size \(the ESS \[T, B\]\)"):
        smc.filter(lambda B: torch.zeros(B, 4), never_called, num_steps=MAX_RECORDS + 1)


@pytest.mark.parametrize(
    "particles",
    [torch.zeros(5, 4, 2), torch.zeros(1, 4), torch.zeros(4), torch.tensor(0.0), {"x": torch.zeros(3, 4)}],
)
def test_init_returning_another_batch_or_no_batch_axis_is_refused_by_name(particles):
    """batch_size=2: a batch of 5 ran as five filters; a 1-d or 0-d state failed with an IndexError."""
    smc = inference.SMC(4)
    with pytest.raises(ValueError, match=r"init must return particles \[B=2, N=4, ...\] \(batch_size, num_particles\)"):
        smc.filter(lambda B: particles, lambda t, p: (p, torch.zeros(2, 4)), num_steps=1, batch_size=2)
