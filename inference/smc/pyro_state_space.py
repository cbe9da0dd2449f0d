"""A Pyro state-space model as the tensor callables ``inference.SMC`` filters.

The model is an object with ``init(state, *init_args)`` and ``step(state[, y])`` that write
its latent state into the dict ``state`` with ``pyro.sample`` (``pyro.infer.SMCFilter``'s
interface). Each call runs under ``poutine.trace`` inside a plate of the B x N particles of
all filters, so latent sites are drawn from their prior (the bootstrap proposal), and the
log-densities of the observed sites (``obs=`` and ``pyro.factor``) are the incremental
log-weights: ``init``'s are the weights the particles start from.
"""

from __future__ import annotations

import pyro
import torch
from pyro import poutine

__all__ = ["state_space_callables"]


def _observations(data, batch_size):
    """``(data [B, T, ...], B, T)`` from observations ``[T, ...]`` (one filter) or
    ``[B, T, ...]`` / ``[1, T, ...]`` (broadcast to ``batch_size`` filters)."""
    if not isinstance(data, torch.Tensor) or data.dim() < 1:
        raise ValueError("data must be a tensor of observations [T, ...] or [B, T, ...]")
    if batch_size is None:
        data = data[None]
    elif data.shape[0] == 1 and batch_size > 1:  # one sequence [1, T, ...]: broadcast to every filter
        data = data.expand(batch_size, *data.shape[1:])
    elif data.shape[0] != batch_size:
        raise ValueError(
            f"data must have shape [batch_size={batch_size}, T, ...] or [1, T, ...] (broadcast), "
            f"got {tuple(data.shape)}"
        )
    return data, data.shape[0], data.shape[1]


def state_space_callables(model, data, batch_size, num_steps, init_args, num_particles):
    """``(init, step, T, B)`` for ``SMC._run``: ``init(B) -> (particles, log-weights [B, N])``
    and ``step(t, particles)`` over particles ``{site: [B, N, ...]}``. Without data,
    ``num_steps`` and ``batch_size`` say how long and how many (``model.step(state)`` then
    takes no observation)."""
    if data is None:
        if num_steps is None or batch_size is None:
            raise ValueError("without data, give num_steps and batch_size")
        B, T, event_shape = batch_size, num_steps, ()
    else:
        data, B, T = _observations(data, batch_size)
        event_shape = data.shape[2:]
    N = num_particles
    reference = data if data is not None else next((a for a in init_args if isinstance(a, torch.Tensor)), None)
    dtype = reference.dtype if reference is not None else torch.get_default_dtype()
    device = reference.device if reference is not None else None

    def flatten(state):
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"model state[{key!r}] must be a tensor, got {type(value).__name__}")
        return {k: v.reshape(B, N, *v.shape[1:]) for k, v in state.items()}

    def unflatten(particles):
        return {k: v.reshape(B * N, *v.shape[2:]) for k, v in particles.items()}

    def run(fn, state, *args):
        with poutine.trace() as tracer, pyro.plate("particles", B * N, dim=-1):
            fn(state, *args)
        trace = tracer.trace
        trace.compute_log_prob()
        increment = torch.zeros(B * N, dtype=dtype, device=device)
        for site in trace.nodes.values():
            if site["type"] == "sample" and site["is_observed"]:
                # the particles are the last batch dim (their plate's, dim=-1); a plate of the
                # model's own (dims -2, ...) multiplies its terms into each particle's weight
                log_prob = site["log_prob"]
                log_prob = log_prob.expand(*log_prob.shape[:-1], B * N) if log_prob.dim() else log_prob.expand(B * N)
                increment = increment + log_prob.reshape(-1, B * N).sum(0)
        return increment.reshape(B, N)

    def init(_):
        state = {}
        increment = run(model.init, state, *init_args)
        return flatten(state), increment

    def step(t, particles):
        state = unflatten(particles)
        if data is None:
            increment = run(model.step, state)
        else:
            y = data[:, t].repeat_interleave(N, 0).reshape(B * N, *event_shape)
            increment = run(model.step, state, y)
        return flatten(state), increment  # after the step has written the new state

    return init, step, T, B
