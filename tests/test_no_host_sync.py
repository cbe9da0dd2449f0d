"""No host synchronisation in a model's forward: every forward runs under a
dispatch mode that fails on a value read (``_local_scalar_dense``, ``is_nonzero``,
``item``) and on a copy from a non-CPU tensor to the CPU, with ``Tensor.tolist``,
``numpy`` and ``item`` patched to fail as well. No GPU is needed: the same forwards
also run on the ``meta`` device, where a value read raises and a tensor made on the
CPU inside the forward (a mask built on the host, then moved) is caught by the mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probformer.models.baselines import Transformer, TransformerConfig
from probformer.models.blocks import check_token_inputs
from probformer.models.folded_context import FoldedContext, FoldedContextConfig
from probformer.models.particle_transformer import ParticleConfig, ParticleTransformer
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig
from probformer.models.swarmformer import SwarmConfig, SwarmFormer

VOCAB = 20
REPOSITORY = str(Path(__file__).resolve().parents[1])


VALUE_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.item.default,
}


COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class HostSyncError(AssertionError):
    pass


def _devices(tree) -> set[torch.device]:
    leaves = tree if isinstance(tree, list | tuple) else [tree]
    return {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}


class RefuseHostSync(TorchDispatchMode):
    """Fails on every operator that makes the host wait for (or read) a device value.
    With ``device`` given (meta here), also on any result that lands elsewhere, so a
    tensor built on the CPU inside the forward is caught even without a GPU."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_READS:
            raise HostSyncError(f"host read of a tensor value: {func}")
        if func in COPIES:
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu":
                raise HostSyncError(f"copy to the CPU: {func}")
        out = func(*args, **kwargs)
        if self.device is not None and _devices(out) - {self.device}:
            raise HostSyncError(f"{func} made a tensor on {_devices(out) - {self.device}}, not {self.device}")
        return out


@pytest.fixture
def no_value_reads(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise HostSyncError("Tensor.tolist/numpy/item in a forward")

    for name in ("tolist", "numpy", "item"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


MODELS = {
    "pt-copy": lambda: ParticleTransformer(
        ParticleConfig(
            vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32, resampling="copy", resampler="multinomial"
        )
    ),
    "pt-mix-threshold": lambda: ParticleTransformer(
        ParticleConfig(vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32, ess_threshold=0.7, jitter=0.1)
    ),
    "pt-none-classification": lambda: ParticleTransformer(
        ParticleConfig(
            vocab_size=VOCAB,
            width=16,
            heads=2,
            layers=2,
            ffn_width=32,
            resampling="none",
            task="classification",
            num_classes=3,
        )
    ),
    "transformer": lambda: Transformer(TransformerConfig(vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32)),
    "universal-post-ln": lambda: Transformer(
        TransformerConfig(vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32, universal=True, norm="post")
    ),
    "swarm-gumbel": lambda: SwarmFormer(
        SwarmConfig(vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32, clusters=4)
    ),
    "swarm-contiguous": lambda: SwarmFormer(
        SwarmConfig(
            vocab_size=VOCAB,
            width=16,
            heads=2,
            layers=2,
            ffn_width=32,
            clusters=4,
            routing="contiguous",
            task="tagging",
            num_classes=3,
        )
    ),
    "folded": lambda: FoldedContext(FoldedContextConfig(vocab_size=VOCAB, width=16, heads=2, ffn_width=32, segment=4)),
    "windowed": lambda: FoldedContext(
        FoldedContextConfig(vocab_size=VOCAB, width=16, heads=2, ffn_width=32, segment=4, folded=False, dropout=0.1)
    ),
}


def _padded_batch(device="cpu"):
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5], [3, 5, 8, 9, 7, 0, 0, 0, 0]], device=device)
    mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    mask[1, 5:] = False
    return tokens, mask


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_reads_no_value(name, training, no_value_reads):
    torch.manual_seed(0)
    model = MODELS[name]().train(training)
    tokens, mask = _padded_batch()
    torch.manual_seed(1)
    unwatched = model(tokens, mask)[0]
    torch.manual_seed(1)  # the same draws (dropout, Gumbel, ancestors) under the mode
    with RefuseHostSync():
        watched = model(tokens, mask)[0]
        if training:
            watched.float().sum().backward()
    torch.testing.assert_close(watched, unwatched, rtol=0, atol=0)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_stays_on_the_inputs_device(name, training):
    """On meta no value can be read and nothing built on the CPU goes unnoticed."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MODELS[name]().train(training)
    tokens, mask = _padded_batch("meta")
    with RefuseHostSync(torch.device("meta")):
        output = model(tokens, mask)
    assert output[0].device.type == "meta"


@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_probabilistic_transformer_forward_reads_no_value(device, kernel, no_value_reads):
    """The CRF's checks (token ids, empty rows, finite potentials) are device-side asserts;
    distance groups are built on the device and topology masks once per (n, device)."""
    with torch.device(device):
        model = ProbabilisticTransformer(
            PTConfig(vocab_size=VOCAB, labels=16, channels=2, rank=4, iterations=2, kernel=kernel, dropout=0.0)
        )
    tokens, mask = _padded_batch(device)
    with RefuseHostSync(torch.device(device) if device == "meta" else None):
        model(tokens, mask)


def test_the_mode_catches_what_it_must():
    tokens, mask = _padded_batch()
    with pytest.raises(HostSyncError), RefuseHostSync():
        if tokens.any():
            pass
    with pytest.raises(HostSyncError), RefuseHostSync():
        float(tokens.sum())
    with pytest.raises(HostSyncError), RefuseHostSync(torch.device("meta")):
        torch.zeros(2, device="meta") + torch.arange(2).to("meta")  # a CPU tensor made, then moved


def test_bad_ids_are_refused_without_a_value_read(no_value_reads):
    tokens, mask = _padded_batch()
    with RefuseHostSync():
        check_token_inputs(tokens, mask, VOCAB)  # good input passes
        for bad in (VOCAB, -1):
            with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {VOCAB}\) \(vocab_size\)"):
                check_token_inputs(tokens.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(bad)), mask, VOCAB)
        with pytest.raises(ValueError, match="every row needs at least one real token"):
            check_token_inputs(tokens, mask & torch.tensor([[True], [False]]), VOCAB)
        # a padded slot may hold anything: only real ids are checked, and padding reads as 0
        checked, _ = check_token_inputs(tokens.masked_fill(~mask, VOCAB + 7), mask, VOCAB)
    assert torch.equal(checked[1], torch.tensor([3, 5, 8, 9, 7, 0, 0, 0, 0]))


@pytest.fixture
def no_host_data_copied_to_a_device(monkeypatch):
    """``torch.tensor``/``torch.as_tensor`` with a ``device`` build the tensor on the host and
    copy it over: a synchronising copy on CUDA (the sync debug mode warns), which the dispatch
    mode above cannot see. A forward must fill device tensors on the device instead."""
    calls = []
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def watched(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename  # ours, not torch's own (its CPU flex reference)
            if kwargs.get("device") is not None and caller.startswith(REPOSITORY) and "site-packages" not in caller:
                calls.append(f"torch.{_name}(..., device={kwargs['device']}) in {caller}")
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, watched)
    return calls


@pytest.mark.parametrize("kernel", ["naive", "fused", "flex"])
@pytest.mark.parametrize("topology", ["full", "window(2) | root()"])
def test_probabilistic_transformer_copies_no_host_data_to_its_device(kernel, topology, no_host_data_copied_to_a_device):
    model = ProbabilisticTransformer(
        PTConfig(vocab_size=VOCAB, labels=16, channels=2, rank=4, iterations=2, kernel=kernel, dropout=0.0,
                 topology=topology)
    )  # fmt: skip
    tokens, mask = _padded_batch()
    no_host_data_copied_to_a_device.clear()  # what the forward does, not the set-up
    with torch.no_grad():  # flex on the CPU runs without gradients
        model(tokens, mask)
    assert no_host_data_copied_to_a_device == []


@pytest.mark.parametrize("name", list(MODELS))
def test_no_model_copies_host_data_to_its_device(name, no_host_data_copied_to_a_device):
    torch.manual_seed(0)
    model = MODELS[name]().train(True)
    tokens, mask = _padded_batch()
    no_host_data_copied_to_a_device.clear()  # what the forward and backward do, not the set-up
    model(tokens, mask)[0].float().sum().backward()
    assert no_host_data_copied_to_a_device == []
