"""Non-finite weights are refused where they enter: ``load_state_dict`` of
every model kind refuses a state with a NaN or infinite value anywhere, names the
tensor, and leaves the model exactly as it was; finite states still load."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.models import registry

CONFIGS = {
    "probabilistic_transformer": dict(vocab_size=20, labels=8, channels=2, rank=2, iterations=1),
    "particle_transformer": dict(vocab_size=20, width=8, heads=2, layers=2, ffn_width=16, max_length=16),
    "transformer": dict(vocab_size=20, width=8, heads=2, layers=2, ffn_width=16, max_length=16),
    "swarmformer": dict(vocab_size=20, width=8, heads=2, layers=3, ffn_width=16, max_length=16),
    "folded_context": dict(vocab_size=20, width=8, heads=2, ffn_width=16),
}


MODELS = {kind: registry.build(kind, config) for kind, config in CONFIGS.items()}


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(CONFIGS)),
    pick=st.integers(0, 10**6),
    value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    where=st.integers(0, 10**6),
)
def test_load_state_dict_refuses_non_finite_weights_and_changes_nothing(kind, pick, value, where):
    model = MODELS[kind]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    floating = [k for k, v in before.items() if v.is_floating_point() and v.numel()]
    name = floating[pick % len(floating)]
    state = {k: v.clone() for k, v in before.items()}
    state[name].view(-1)[where % state[name].numel()] = value
    with pytest.raises(ValueError, match=f"weight '{name}' holds NaN or infinite values"):
        model.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.load_state_dict(before)  # a finite state loads
