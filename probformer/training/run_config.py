"""Training-run configs: TOML files with three tables, validated on load (unknown keys,
wrong types and out-of-range values are errors naming ``table.key``).

    [model]   kind = "probabilistic_transformer" | "particle_transformer" | "transformer",
              then that model's config keys (vocab_size, num_classes and task are
              filled in from the data)
    [data]    DataConfig
    [train]   TrainConfig
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from probformer.models.config import ConfigMixin

__all__ = ["DataConfig", "TrainConfig", "RunConfig", "load", "SOURCES", "TASKS", "SCHEDULES"]

SOURCES = ("ptb", "ewt")  # or a path to a text file / folder
TASKS = ("mlm", "pos", "lm")
CAUSAL_MODELS = ("folded_context",)  # the models that may learn next-token prediction
SCHEDULES = ("linear", "cosine", "constant")


@dataclass
class DataConfig(ConfigMixin):
    source: str = "ptb"  # "ptb", "ewt", or a text file / folder of *.txt
    task: str = "mlm"  # "mlm", "pos" (UPOS tagging; source "ewt") or "lm" (next token; causal models)
    max_length: int = 128  # longer sentences are an error, reported before training
    vocabulary: int = 10_000  # word vocabulary cap (ptb/ewt), subword vocabulary size (text)
    train_sentences: int = 0  # use the first N training sentences (0: all)
    valid_sentences: int = 0  # use the first N validation sentences (0: all)
    mask_rate: float = 0.15  # BERT masking, 80/10/10

    def __post_init__(self):
        self.check_integers({"max_length": 1, "vocabulary": 4, "train_sentences": 0, "valid_sentences": 0})
        if self.task not in TASKS:
            raise ValueError(f"config key 'data.task' must be one of {list(TASKS)}, got {self.task!r}")
        if self.task == "pos" and self.source != "ewt":
            raise ValueError("config key 'data.task'='pos' needs 'data.source'='ewt' (the treebank with UPOS tags)")
        if not 0 < self.mask_rate < 1:
            raise ValueError(f"config key 'data.mask_rate' must lie in (0, 1), got {self.mask_rate!r}")


@dataclass
class TrainConfig(ConfigMixin):
    seed: int = 0
    batch_size: int = 32  # global: split across DDP processes
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    schedule: str = "linear"  # decay after warm-up: "linear", "cosine" (to 0) or "constant"
    epochs: int = 1
    steps: int = 0  # stop after this many steps (0: after `epochs` epochs)
    clip: float = 1.0  # gradient-norm clip (0: none)
    bf16: bool = False  # bf16 autocast for the forward pass
    eval_every: int = 0  # steps between validations (0: only at the end)
    eval_sentences: int = 0  # validation sentences per periodic evaluation (0: all)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    log_every: int = 10  # steps between metrics lines
    threads: int = 0  # torch threads (0: OMP_NUM_THREADS, else min(2, cores) / processes)

    def __post_init__(self):
        self.check_integers(
            {
                "seed": 0,
                "batch_size": 1,
                "warmup_steps": 0,
                "epochs": 1,
                "steps": 0,
                "eval_every": 0,
                "eval_sentences": 0,
                "checkpoint_every": 0,
                "log_every": 1,
                "threads": 0,
            }
        )
        if not self.lr > 0:
            raise ValueError(f"config key 'train.lr' must be > 0, got {self.lr!r}")
        if self.weight_decay < 0 or self.clip < 0:
            raise ValueError("config keys 'train.weight_decay' and 'train.clip' must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"config key 'train.schedule' must be one of {list(SCHEDULES)}, got {self.schedule!r}")


@dataclass
class RunConfig:
    model: dict  # kind + the model config's keys
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def kind(self) -> str:
        return self.model["kind"]

    def to_dict(self) -> dict:
        return {"model": dict(self.model), "data": self.data.to_dict(), "train": self.train.to_dict()}

    @classmethod
    def from_dict(cls, values: dict) -> RunConfig:
        from probformer.training.checkpoint import MODELS

        if not isinstance(values, dict):
            raise ValueError("a run config must be a table with [model], [data] and [train]")
        unknown = sorted(set(values) - {"model", "data", "train"})
        if unknown:
            raise ValueError(f"unknown config tables {unknown}; allowed: ['data', 'model', 'train']")
        model = values.get("model")
        if not isinstance(model, dict) or "kind" not in model:
            raise ValueError(f"config table [model] needs 'kind', one of {sorted(MODELS)}")
        if model["kind"] not in MODELS:
            raise ValueError(f"config key 'model.kind' must be one of {sorted(MODELS)}, got {model['kind']!r}")
        for filled in ("vocab_size", "num_classes", "task"):
            if filled in model:
                raise ValueError(f"config key 'model.{filled}' is set from the data; remove it")
        config = cls(
            model=dict(model),
            data=DataConfig.from_dict(values.get("data", {}), "data"),
            train=TrainConfig.from_dict(values.get("train", {}), "train"),
        )
        causal = model["kind"] in CAUSAL_MODELS
        if causal != (config.data.task == "lm"):
            raise ValueError(
                f"config key 'data.task'='lm' (next-token prediction) needs a causal model, one of "
                f"{list(CAUSAL_MODELS)}, and those models learn only 'lm'; got model.kind={model['kind']!r} "
                f"with data.task={config.data.task!r}"
            )
        config.model_config(vocab_size=8, num_classes=2)  # validate the model keys now
        return config

    def model_config(self, vocab_size: int, num_classes: int = 0):
        from probformer.training.checkpoint import MODELS

        config_cls, _ = MODELS[self.kind]
        keys = {k: v for k, v in self.model.items() if k != "kind"}
        keys["vocab_size"] = vocab_size
        if self.data.task == "pos":
            keys["task"], keys["num_classes"] = "tagging", num_classes
        if "max_length" in config_cls.__dataclass_fields__ and "max_length" not in keys:
            keys["max_length"] = self.data.max_length
        return config_cls.from_dict(keys, "model")


def load(path) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    return RunConfig.from_dict(values)
