"""SMC accepts the same kinds of input everywhere: dict or tensor state, data
broadcast over the batch, and a clear error for an empty or non-tensor state."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from inference import SMC


class RandomWalk:
    """A Pyro model object (SMCFilter's interface): x_t = x_{t-1} + noise, y_t ~ N(x_t, 1)."""

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(state["x"], 0.5))
        pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)


def test_one_sequence_of_data_is_broadcast_to_every_filter():
    ys = torch.tensor([[0.3, -0.2, 0.5, 1.0]], dtype=torch.float64)  # [1, T]

    def run(data):
        torch.manual_seed(0)
        return SMC(64, generator=torch.Generator().manual_seed(1)).filter(RandomWalk(), data, batch_size=3)

    broadcast, explicit = run(ys), run(ys.expand(3, -1))
    assert broadcast.log_evidence.shape == (3,)
    torch.testing.assert_close(broadcast.log_evidence, explicit.log_evidence, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"data must have shape \[batch_size=3, T, ...\] or \[1, T, ...\]"):
        SMC(8).filter(RandomWalk(), torch.zeros(2, 4, dtype=torch.float64), batch_size=3)


def test_tensor_and_dict_states_give_the_same_filter():
    increments = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))

    def run(as_dict):
        def init(B):
            x = torch.zeros(B, 16)
            return {"x": x} if as_dict else x

        def step(t, particles):
            return particles, increments[t]

        return SMC(16, generator=torch.Generator().manual_seed(3)).filter(init, step, num_steps=5, batch_size=2)

    as_tensor, as_dict = run(False), run(True)
    torch.testing.assert_close(as_tensor.log_evidence, as_dict.log_evidence, rtol=0, atol=0)
    assert torch.equal(as_tensor.ancestors, as_dict.ancestors) and set(as_dict.particles) == {"x"}


@pytest.mark.parametrize(
    "state,error,match",
    [
        ({}, ValueError, "init returned an empty state"),
        ([1.0, 2.0], TypeError, r"init must return particles as a tensor \[B, N, ...\] or a dict of them"),
        ({"x": 3.0}, TypeError, r"init: state\['x'\] must be a tensor \[B, N, ...\], got float"),
        ({"x": torch.zeros(4)}, TypeError, r"state\['x'\] must be a tensor \[B, N, ...\]"),
    ],
)
def test_an_empty_or_non_tensor_state_is_refused_by_name(state, error, match):
    with pytest.raises(error, match=match):
        SMC(4).filter(lambda B: state, lambda t, x: (x, torch.zeros(1, 4)), num_steps=1)


def test_a_pyro_model_that_writes_no_state_or_a_number_is_refused_by_name():
    class Empty:
        def init(self, state):
            pass

        def step(self, state, y=None):
            pass

    class Number(Empty):
        def init(self, state):
            state["x"] = 1.0

    with pytest.raises(ValueError, match="empty state"):
        SMC(4).filter(Empty(), torch.zeros(3))
    with pytest.raises(TypeError, match=r"model state\['x'\] must be a tensor, got float"):
        SMC(4).filter(Number(), torch.zeros(3))
