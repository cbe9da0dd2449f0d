"""Checkpoints: a directory with ``config.json`` (format, model kind, config),
``model.safetensors`` (weights; never pickle) and optionally ``vocabulary.json`` (and
``tokenizer.json`` for a subword vocabulary).
Every file is written to a temporary name and renamed into place, so a killed
process leaves either the old file or the new one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from probformer.models.baselines import Transformer, TransformerConfig
from probformer.models.blocks import check_state
from probformer.models.folded_context import FoldedContext, FoldedContextConfig
from probformer.models.particle_transformer import ParticleConfig, ParticleTransformer
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig
from probformer.models.swarmformer import SwarmConfig, SwarmFormer
from probformer.training.data import SubwordVocabulary, Vocabulary

__all__ = ["save", "load", "MODELS", "FORMAT"]

FORMAT = "probformer-checkpoint/1"
MODELS = {
    "probabilistic_transformer": (PTConfig, ProbabilisticTransformer),
    "particle_transformer": (ParticleConfig, ParticleTransformer),
    "transformer": (TransformerConfig, Transformer),
    "swarmformer": (SwarmConfig, SwarmFormer),
    "folded_context": (FoldedContextConfig, FoldedContext),
}


def _kind(model) -> str:
    for kind, (_, cls) in MODELS.items():
        if isinstance(model, cls):
            return kind
    raise ValueError(f"cannot checkpoint a {type(model).__name__}; known models: {sorted(MODELS)}")


def _unique_state(model) -> dict:
    """The state dict with every shared tensor once (the PT's ``crf`` is also
    ``mean_field.crf``): safetensors refuses aliased tensors."""
    seen, unique = set(), {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = tensor
    return unique


def _atomic_write(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(temporary)
    os.replace(temporary, path)


def save(model, directory, vocabulary: Vocabulary | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in _unique_state(model).items()}
    _atomic_write(directory / "model.safetensors", lambda p: save_file(weights, str(p)))
    meta = {"format": FORMAT, "model": _kind(model), "config": model.config.to_dict()}
    _atomic_write(directory / "config.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
    if vocabulary is not None:
        _atomic_write(directory / "vocabulary.json", lambda p: p.write_text(json.dumps(vocabulary.words)))
        if isinstance(vocabulary, SubwordVocabulary):
            _atomic_write(directory / "tokenizer.json", vocabulary.save)
    return directory


def load(directory):
    """``(model, vocabulary or None)`` from a checkpoint directory; a clear error for
    anything that is not one."""
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"not a probformer checkpoint: {path} is missing")
    try:
        meta = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{config_path}: format must be {FORMAT!r}, got {meta.get('format') if isinstance(meta, dict) else meta!r}"
        )
    if meta.get("model") not in MODELS:
        raise ValueError(f"{config_path}: unknown model {meta.get('model')!r}; known: {sorted(MODELS)}")
    config_cls, model_cls = MODELS[meta["model"]]
    model = model_cls(config_cls.from_dict(meta.get("config", {}), section="config"))
    try:
        weights = load_file(str(weights_path))
    except Exception as error:  # safetensors raises its own errors on truncated or foreign files
        raise ValueError(f"{weights_path} is not a readable safetensors file: {error}") from None
    check_state(weights, _unique_state(model), weights_path)
    model.load_state_dict(weights, strict=False)  # aliases of the saved tensors fill themselves
    vocabulary = None
    if (directory / "tokenizer.json").is_file():
        vocabulary = SubwordVocabulary.load(directory / "tokenizer.json")
    elif (directory / "vocabulary.json").is_file():
        vocabulary = Vocabulary(json.loads((directory / "vocabulary.json").read_text()))
        if len(vocabulary) != model.config.vocab_size:
            raise ValueError(
                f"vocabulary has {len(vocabulary)} words but the model's vocab_size is {model.config.vocab_size}"
            )
    return model, vocabulary
