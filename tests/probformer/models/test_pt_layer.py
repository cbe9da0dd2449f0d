"""probformer.PTLayer: PT inference as a layer on hidden states."""

from __future__ import annotations

import pytest
import torch

import probformer
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig

V = 7


def test_one_hot_hidden_states_give_the_pts_own_posterior():
    """With hidden states one_hot(tokens) and the PT's tables, the layer's engine sees the
    PT's unary potentials exactly, so its posterior is the PT's, bit for bit."""
    torch.manual_seed(0)
    pt = ProbabilisticTransformer(
        PTConfig(vocab_size=V, labels=5, channels=2, rank=3, iterations=3, dropout=0.0, kernel="naive")
    ).eval()
    layer = probformer.PTLayer(V, labels=5, channels=2, rank=3, iterations=3, kernel="naive").eval()
    layer.crf.load_state_dict(pt.crf.state_dict())
    tokens = torch.randint(0, V, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:], mask[2, 1:] = False, False
    hidden = torch.nn.functional.one_hot(tokens, V).float()
    with torch.no_grad():
        ours = layer.posterior(hidden, mask).logits
        theirs = pt.mean_field(tokens, mask).logits
    assert torch.equal(ours, theirs)


def test_shape_padding_and_gradients():
    torch.manual_seed(0)
    layer = probformer.PTLayer(12, labels=6, channels=2, rank=3, iterations=2)
    hidden = torch.randn(2, 5, 12, requires_grad=True)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out = layer(hidden, mask)
    assert out.shape == (2, 5, 12) and out.dtype == hidden.dtype
    assert (out[1, 3:] == 0).all()  # padded positions are zero
    alone = layer(hidden[1:, :3].detach(), mask[1:, :3])  # the padded row, unpadded
    torch.testing.assert_close(out[1:, :3], alone, atol=1e-6, rtol=1e-6)
    out.square().sum().backward()
    assert hidden.grad[:, :3].abs().sum() > 0 and torch.isfinite(hidden.grad).all()
    assert (hidden.grad[1, 3:] == 0).all()  # padding gets no gradient
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_bad_inputs_are_refused_naming_them():
    layer = probformer.PTLayer(4, labels=3, channels=1, rank=2)
    with pytest.raises(ValueError, match="embedding_size"):
        layer(torch.randn(1, 3, 5))
    with pytest.raises(TypeError, match="hidden must be a floating"):  # the layer's own argument
        layer(torch.ones(1, 3, 4, dtype=torch.long))
