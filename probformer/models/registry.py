"""Every model kind in one table: its name in files, its config class and its model class.

Checkpoints, exports and the trainer find a model here by the ``kind`` string they
store, so a model file never needs to know who saves or loads it. Modules are
imported on first use: loading one kind imports only that kind's code.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

__all__ = ["KINDS", "classes", "kind_of", "build", "unique_state", "check_weights", "LogitsOnly"]

# kind -> (module, config class, model class)
KINDS = {
    "probabilistic_transformer": ("probabilistic_transformer", "PTConfig", "ProbabilisticTransformer"),
    "particle_transformer": ("particle_transformer", "ParticleConfig", "ParticleTransformer"),
    "transformer": ("baselines", "TransformerConfig", "Transformer"),
    "swarmformer": ("swarmformer", "SwarmConfig", "SwarmFormer"),
    "folded_context": ("folded_context", "FoldedContextConfig", "FoldedContext"),
}


def classes(kind: str) -> tuple[type, type]:
    """``(config class, model class)`` of ``kind``; ``ValueError`` naming the known kinds."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {sorted(KINDS)}")
    module, config_name, model_name = KINDS[kind]
    found = importlib.import_module(f"probformer.models.{module}")
    return getattr(found, config_name), getattr(found, model_name)


def kind_of(model) -> str:
    """The kind of a model instance (under DDP or torch.compile too) or of a model class."""
    model = getattr(model, "module", getattr(model, "_orig_mod", model))
    cls = model if isinstance(model, type) else type(model)
    for kind, (module, _, model_name) in KINDS.items():
        if cls.__name__ == model_name and cls.__module__ == f"probformer.models.{module}":
            return kind
    raise ValueError(f"not a probformer model: {cls.__name__}; known kinds: {sorted(KINDS)}")


def build(kind: str, config: dict, section: str = "config") -> nn.Module:
    """A freshly initialised model of ``kind`` from a plain config dict (as stored in a
    checkpoint or an export); every value is checked by the config class."""
    config_cls, model_cls = classes(kind)
    return model_cls(config_cls.from_dict(config, section=section))


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with every shared tensor once (the PT's ``crf`` is also
    ``mean_field.crf``): safetensors refuses aliased tensors; loading fills the aliases."""
    seen, unique = set(), {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = tensor
    return unique


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_weights(found: dict[str, tuple[torch.dtype, tuple]], model: torch.nn.Module, where, aliases_once: bool):
    """Check ``{name: (dtype, shape)}`` against ``model``'s state dict: no unknown name,
    every tensor present (a tensor shared under several names in the model: exactly
    once if ``aliases_once``, else at least once), shapes equal, integer and bool dtypes
    equal, floating tensors all in one floating dtype. Returns that dtype (or None)."""
    expected = model.state_dict(keep_vars=True)
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise ValueError(f"{where}: tensors the model does not have: {unknown[:5]}")
    groups: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    for names in groups.values():
        present = [name for name in names if name in found]
        if not present or (aliases_once and len(present) > 1):
            what = "missing" if not present else f"stored {len(present)} times (one tensor shared by {names})"
            raise ValueError(f"{where}: tensor {names[0]!r} is {what}")
    floating = set()
    for name, (dtype, shape) in found.items():
        want = expected[name]
        if tuple(shape) != tuple(want.shape):
            raise ValueError(
                f"{where}: shape mismatch: {name!r} has shape {tuple(shape)} in the file, "
                f"{tuple(want.shape)} by the config"
            )
        if want.dtype.is_floating_point and dtype in FLOAT_DTYPES:
            floating.add(dtype)
        elif dtype != want.dtype:
            raise ValueError(f"{where}: {name!r} has dtype {dtype} in the file, {want.dtype} by the model")
    if len(floating) > 1:
        raise ValueError(f"{where}: floating tensors in several dtypes {sorted(map(str, floating))}; one is expected")
    return floating.pop() if floating else None


class LogitsOnly(nn.Module):
    """The inference view of any model: ``(tokens, mask) -> logits``, the model's own
    forward with its second output (posterior, trace) dropped. Exports trace this, so
    the exported graph is the trained model's forward, not a restatement of it.

    ``pad_to`` (causal models only: FoldedContext) right-pads every input to that many
    positions and cuts the logits back: the forward then runs a fixed number of
    segments, which a traced graph needs, and right-padding changes no earlier output
    of a causal model."""

    def __init__(self, model: nn.Module, pad_to: int | None = None):
        super().__init__()
        self.model, self.pad_to = model, pad_to

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pad_to is not None:
            n = tokens.shape[1]
            torch._check(n <= self.pad_to, lambda: f"sequence length {n} exceeds max_length={self.pad_to}")
            mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
            # one position more than the longest input: the padding is never empty, so the
            # traced graph has no special case at n == pad_to
            tokens = nn.functional.pad(tokens, (0, self.pad_to + 1 - n))
            mask = nn.functional.pad(mask, (0, self.pad_to + 1 - n), value=False)
        out = self.model(tokens, mask)
        logits = out[0] if isinstance(out, tuple) else out
        return logits if self.pad_to is None else logits[:, :n]
