"""What every config shares: validated integer keys, ``from_dict`` that rejects
unknown keys and values of the wrong type (naming the key), ``to_dict`` for
checkpoints."""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, asdict, fields

__all__ = ["ConfigMixin"]


class ConfigMixin:
    def check_integers(self, minimums: dict[str, int]) -> None:
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"config key {name!r} must be an integer >= {minimum}, got {value!r}")

    def check_flags(self, *names: str) -> None:
        for name in names:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config key {name!r} must be true or false, got {getattr(self, name)!r}")

    def check_dropout(self) -> None:
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"config key 'dropout' must lie in [0, 1), got {self.dropout!r}")

    def check_task(self, model: str) -> None:
        """``task``, ``pooling`` (mean only: no ROOT node) and ``num_classes`` of a
        network with a ``TaskHead``."""
        from probformer.models.blocks import TASKS

        if self.task not in TASKS:
            raise ValueError(f"config key 'task' must be one of {list(TASKS)}, got {self.task!r}")
        if self.pooling != "mean":
            raise ValueError(f"config key 'pooling' must be 'mean' for a {model}, got {self.pooling!r}")
        if self.task != "mlm" and self.num_classes < 1:
            raise ValueError(f"config key 'num_classes' must be >= 1 for task {self.task!r}")

    @classmethod
    def from_dict(cls, values: dict, section: str = ""):
        """Build from a plain dict (JSON, TOML); ``section`` prefixes key names in errors."""
        prefix = f"{section}." if section else ""
        if not isinstance(values, dict):
            raise ValueError(f"config section {section or '(top)'!r} must be a table, got {values!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown config keys {[prefix + k for k in unknown]}; allowed: {sorted(known)}")
        missing = [name for name, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in missing if name not in values]
        if missing:
            raise ValueError(f"config keys {[prefix + k for k in missing]} are required")
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            if not _matches(value, hints[name]):
                raise ValueError(
                    f"config key {prefix + name!r} must be of type {_describe(hints[name])}, "
                    f"got {type(value).__name__} {value!r}"
                )
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def _matches(value, hint) -> bool:
    if hint is typing.Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    origin = typing.get_origin(hint) or hint
    return isinstance(value, origin)


def _describe(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))
