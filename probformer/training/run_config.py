"""Training-run configs: TOML files with three tables, validated on load (unknown keys,
wrong types and out-of-range values are errors naming ``table.key``).

    [model]   kind = "probabilistic_transformer" | "particle_transformer" | "transformer",
              then that model's config keys (vocab_size, num_classes and task are
              filled in from the data)
    [data]    DataConfig
    [train]   TrainConfig
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from probformer.models import registry
from probformer.models.config import ALIASES, ConfigMixin

__all__ = [
    "DataConfig",
    "TrainConfig",
    "RunConfig",
    "load",
    "apply_overrides",
    "parse_override",
    "SOURCES",
    "TASKS",
    "SCHEDULES",
]

SOURCES = ("ptb", "ewt")  # or a path to a text file / folder
TASKS = ("mlm", "pos", "lm")
CAUSAL_MODELS = ("folded_context",)  # the models that may learn next-token prediction
SCHEDULES = ("linear", "cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")  # train.device
LONG_SENTENCES = ("error", "windows")  # what training does with a sentence longer than data.max_length
# Limits far beyond any run this library is for, but below what would exhaust memory or
# time before the first step: a typo (an extra zero, 1e9 for 1e-3) is refused, naming the key.
# (ConfigMixin's generic LIMITS apply first; these are the run config's own, tighter ones.
# The model's size is refused by its config class, from an estimate: nothing is allocated.)
_DATA_RANGES = {
    "max_length": (1, 16_384),
    "vocabulary": (4, 1_000_000),
    "train_sentences": (0, 100_000_000),
    "valid_sentences": (0, 100_000_000),
}
_TRAIN_RANGES = {
    "seed": (0, 2**32 - 1),  # seeds are multiplied by ~1e6 and must stay below torch's 2**64
    "batch_size": (1, 65_536),
    "warmup_steps": (0, 100_000_000),
    "epochs": (1, 100_000),
    "steps": (0, 100_000_000),
    "eval_every": (0, 100_000_000),
    "eval_sentences": (0, 100_000_000),
    "patience": (0, 100_000_000),
    "checkpoint_every": (0, 100_000_000),
    "log_every": (1, 100_000_000),
    "diagnostics_every": (0, 100_000_000),
    "threads": (0, 1_024),
}
_TRAIN_REALS = {"lr": (0.0, 10.0, False), "weight_decay": (0.0, 10.0, True), "clip": (0.0, 1e6, True)}


def _check_integer_ranges(config, section: str, ranges: dict[str, tuple[int, int]]) -> None:
    for name, (low, high) in ranges.items():
        value = getattr(config, name)
        message = f"config key '{section}.{name}' must be an integer in [{low}, {high:,}], got {value!r}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(message)
        if not low <= value <= high:
            raise ValueError(message)


def _check_real_ranges(config, section: str, ranges: dict[str, tuple[float, float, bool]]) -> None:
    """``(low, high, low allowed)``: finite numbers in the range (NaN and infinities refused)."""
    for name, (low, high, closed) in ranges.items():
        value = getattr(config, name)
        interval = f"{'[' if closed else '('}{low:g}, {high:g}]"
        message = f"config key '{section}.{name}' must be a finite number in {interval}, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(message)
        if not math.isfinite(value) or not (low <= value if closed else low < value) or value > high:
            raise ValueError(message)


@dataclass
class DataConfig(ConfigMixin):
    source: str = "ptb"  # "ptb", "ewt", a text file / folder of *.txt, or "hf:..." (docs/data.md)
    task: str = "mlm"  # "mlm", "pos" (UPOS tagging; source "ewt") or "lm" (next token; causal models)
    max_length: int = 128  # longer sentences: see long_sentences
    long_sentences: str = "error"  # "error" (reported before training) or "windows" (cut into max_length pieces)
    vocabulary: int = 10_000  # word vocabulary cap (ptb/ewt), subword vocabulary size (text)
    train_sentences: int = 0  # use the first N training sentences (0: all)
    valid_sentences: int = 0  # use the first N validation sentences (0: all)
    mask_rate: float = 0.15  # BERT masking, 80/10/10

    def __post_init__(self):
        _check_integer_ranges(self, "data", _DATA_RANGES)
        if self.task not in TASKS:
            raise ValueError(f"config key 'data.task' must be one of {list(TASKS)}, got {self.task!r}")
        if self.long_sentences not in LONG_SENTENCES:
            raise ValueError(
                f"config key 'data.long_sentences' must be one of {list(LONG_SENTENCES)}, got {self.long_sentences!r}"
            )
        if self.task == "pos" and self.source != "ewt":
            raise ValueError("config key 'data.task'='pos' needs 'data.source'='ewt' (the treebank with UPOS tags)")
        if isinstance(self.mask_rate, bool) or not 0 < self.mask_rate < 1:
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
    steps: int = 0  # stop after this many steps, whatever `epochs` says (0: after `epochs` epochs)
    clip: float = 1.0  # gradient-norm clip (0: none)
    bf16: bool = False  # bf16 autocast for the forward pass
    eval_every: int = 0  # steps between validations (0: only at the end)
    eval_sentences: int = 0  # validation sentences per periodic evaluation (0: all)
    patience: int = 0  # stop after this many periodic validations without a new best loss (0: never)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    log_every: int = 10  # steps between metrics lines
    diagnostics_every: int = 100  # steps between per-layer ESS/diversity metrics (PT, Particle; 0: never)
    threads: int = 0  # torch threads (0: OMP_NUM_THREADS, else min(2, cores) / processes)
    device: str = "auto"  # "auto" (CUDA when present), "cpu" or "cuda"; bf16 autocast on CUDA
    hold_freed_memory: bool = False  # CPU: the process reuses freed memory, not fresh pages (faster; more RSS)

    def __post_init__(self):
        _check_integer_ranges(self, "train", _TRAIN_RANGES)
        _check_real_ranges(self, "train", _TRAIN_REALS)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"config key 'train.schedule' must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.patience and not self.eval_every:
            raise ValueError(
                f"config key 'train.patience'={self.patience} needs periodic validation: set 'train.eval_every' > 0"
            )
        if self.device not in DEVICES:
            raise ValueError(f"config key 'train.device' must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("config key 'train.device' is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")


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
        if not isinstance(values, dict):
            raise ValueError("a run config must be a table with [model], [data] and [train]")
        unknown = sorted(set(values) - {"model", "data", "train"})
        if unknown:
            raise ValueError(f"unknown config tables {unknown}; allowed: ['data', 'model', 'train']")
        model = values.get("model")
        if not isinstance(model, dict) or "kind" not in model:
            raise ValueError(f"config table [model] needs 'kind', one of {sorted(registry.KINDS)}")
        if not isinstance(model["kind"], str) or model["kind"] not in registry.KINDS:  # a list is unhashable
            raise ValueError(f"config key 'model.kind' must be one of {sorted(registry.KINDS)}, got {model['kind']!r}")
        for filled in ("vocab_size", "num_classes", "task"):
            if filled in model:
                raise ValueError(f"config key 'model.{filled}' is set from the data; remove it")
        config_cls, _ = registry.classes(model["kind"])
        keys = {k: v for k, v in model.items() if k != "kind"}
        # aliases (hidden_size, ...) renamed: run.json and a resume compare canonical keys
        model = {"kind": model["kind"], **config_cls.canonical_keys(keys, "model")}
        config = cls(
            model=model,
            data=_in_section("data", lambda: DataConfig.from_dict(values.get("data", {}), "data")),
            train=_in_section("train", lambda: TrainConfig.from_dict(values.get("train", {}), "train")),
        )
        causal = model["kind"] in CAUSAL_MODELS
        if causal != (config.data.task == "lm"):
            raise ValueError(
                f"config key 'data.task'='lm' (next-token prediction) needs a causal model, one of "
                f"{list(CAUSAL_MODELS)}, and those models learn only 'lm'; got model.kind={model['kind']!r} "
                f"with data.task={config.data.task!r}"
            )
        # validate the model keys (and the model's size) now, at the largest vocabulary the data may give
        built = config.model_config(vocab_size=config.data.vocabulary + 8, num_classes=2)
        if getattr(built, "max_length", config.data.max_length) < config.data.max_length:
            raise ValueError(
                f"config key 'model.max_length' ({built.max_length}) is below 'data.max_length' "
                f"({config.data.max_length}): the model could not read the longest sentences the data gives it; "
                "raise model.max_length or lower data.max_length"
            )
        return config

    def model_config(self, vocab_size: int, num_classes: int = 0):
        config_cls, _ = registry.classes(self.kind)
        keys = {k: v for k, v in self.model.items() if k != "kind"}
        keys["vocab_size"] = vocab_size
        if self.data.task == "pos":
            keys["task"], keys["num_classes"] = "tagging", num_classes
        if "max_length" in config_cls.__dataclass_fields__ and "max_length" not in keys:
            keys["max_length"] = self.data.max_length
        return _in_section("model", lambda: config_cls.from_dict(keys, "model"))


def _in_section(section: str, build):
    """``build()``, with the keys named in its errors put in their table: the config
    classes name ``'lr'``, a run config's user wrote ``train.lr``."""
    try:
        return build()
    except (ValueError, TypeError) as error:  # the same type, the key named in its table
        # a name already in a table is kept; a dotted name inside one key ('weights.unary') gets its table too
        named = re.sub(r"config key '(?!(?:model|data|train)\.)(\w+)", rf"config key '{section}.\1", str(error))
        raise type(error)(named) from None


def parse_override(assignment: str) -> tuple[list[str], object]:
    """``"train.lr=3e-4"`` -> ``(["train", "lr"], 0.0003)``: a dotted key into the TOML
    tables and a TOML value (``3e-4`` a float, ``true`` a bool, ``"full"`` or a bare word
    that is not TOML, such as ``full`` or ``window(2)``, a string)."""
    if not isinstance(assignment, str):
        raise TypeError(f"--set takes a string KEY=VALUE, got {type(assignment).__name__}")
    key, equals, text = assignment.partition("=")
    path = key.strip().split(".")
    if not equals or len(path) < 2 or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", part) for part in path):
        raise ValueError(f"--set {assignment!r}: expected TABLE.KEY=VALUE, e.g. model.rank=32 or train.lr=3e-4")
    if path[0] not in ("model", "data", "train"):
        raise ValueError(f"--set {assignment!r}: unknown config table {path[0]!r}; allowed: ['data', 'model', 'train']")
    text = text.strip()
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        if not text or any(c in text for c in "\"'[]{}\n"):  # meant as TOML but malformed: say so
            raise ValueError(f"--set {assignment!r}: {text!r} is not a TOML value") from None
        value = text  # a bare word: a string
    return path, value


def apply_overrides(values: dict, assignments) -> dict:
    """A copy of the TOML tables ``values`` with each ``TABLE.KEY=VALUE`` of
    ``assignments`` set, as if written in the file (the result is then validated like
    the file: unknown keys and wrong types are errors naming ``table.key``)."""
    values = {name: dict(table) if isinstance(table, dict) else table for name, table in values.items()}
    for assignment in assignments:
        path, value = parse_override(assignment)
        table = values
        for depth, part in enumerate(path[:-1]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ValueError(f"--set {assignment!r}: {'.'.join(path[: depth + 1])!r} is a value, not a table")
        for same in _same_setting(path[-1]):  # --set model.hidden_size=.. replaces the file's labels
            table.pop(same, None)
        table[path[-1]] = value
    return values


def _same_setting(key: str) -> set[str]:
    """The other names of ``key``'s setting: its canonical keys if it is an alias
    (``hidden_size`` -> labels, width), its aliases if it is canonical."""
    if key in ALIASES:
        return set(ALIASES[key])
    return {alias for alias, canonical in ALIASES.items() if key in canonical}


def load(path, overrides=()) -> RunConfig:
    """The run config in the TOML file ``path``, with ``overrides`` (``TABLE.KEY=VALUE``
    strings, ``probformer train --set``) applied before validation."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    return RunConfig.from_dict(apply_overrides(values, overrides))
