"""What every model config shares: validated integer keys, ``from_dict`` that rejects
unknown keys, ``to_dict`` for checkpoints."""

from __future__ import annotations

from dataclasses import asdict, fields

__all__ = ["ConfigMixin"]


class ConfigMixin:
    def check_integers(self, minimums: dict[str, int]) -> None:
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"config key {name!r} must be an integer >= {minimum}, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)
