"""What ``SMC.filter``'s ``step`` returns, refused by name: increments on another device than
the particles (e.g. 'meta') failed with torch's cross-device error, increments that were not
a tensor with an AttributeError and a step returning one value with Python's unpacking error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import inference

pytestmark = pytest.mark.usefixtures("one_thread")


def init(batch_size):
    return torch.zeros(batch_size, 4)


@given(batch_size=st.integers(1, 3), steps=st.integers(1, 4), at=st.data())
def test_increments_on_another_device_are_refused_by_name(batch_size, steps, at):
    bad = at.draw(st.integers(0, steps - 1))

    def step(t, particles):
        device = "meta" if t == bad else "cpu"
        return particles, torch.zeros(particles.shape[:2], device=device)

    words = rf"step must return log-incremental weights on the particles' device cpu, got meta \(at step {bad}\)"
    with pytest.raises(ValueError, match=words):
        inference.SMC(4).filter(init, step, steps, batch_size=batch_size)


@pytest.mark.parametrize("increment", [[[0.0] * 4], 0.0, None, {"w": torch.zeros(1, 4)}])
def test_increments_that_are_not_a_tensor_are_refused_by_name(increment):
    with pytest.raises(TypeError, match=r"step must return log-incremental weights as a tensor \[B, N\]"):
        inference.SMC(4).filter(init, lambda t, p: (p, increment), 2)


@pytest.mark.parametrize("returned", [lambda p: p, lambda p: (p,), lambda p: (p, torch.zeros(1, 4), None)])
def test_a_step_that_returns_other_than_a_pair_is_refused_by_name(returned):
    with pytest.raises(TypeError, match=r"step must return \(particles, log-incremental weights \[B, N\]\)"):
        inference.SMC(4).filter(init, lambda t, p: returned(p), 2)


def test_a_step_on_the_particles_device_runs():
    result = inference.SMC(4).filter(init, lambda t, p: [p + 1, torch.zeros(2, 4)], 3, batch_size=2)
    assert torch.equal(result.particles, torch.full((2, 4), 3.0)) and result.log_evidence.isfinite().all()
