"""μP for the Probabilistic Transformer: tune at a small width, transfer wide.

The engine owns the maths (``inference.MeanField(..., mup=True, mup_scales=...)``:
temperature tau = d / r on the labels, head logits at 1/r in quasi-distribution
units, pt-spec.md §4.2). This module only configures it, from two config keys that
travel with the model (``config.json`` of a checkpoint, ``model.config`` under DDP):

    mup_base_width   d0, the width the hyper-parameters were tuned at (0: this width)
    mup_paradigm     "channels" (grow C, rank r fixed) or "rank" (grow r, C fixed)

Every factor is relative to the base width, so **at d = d0 the μP model is the
standard one**: same engine scales, same initial parameters, same learning rates.
Away from it, with m = d / d0:

    group    parameters                    init std            learning rate
    input    unary S, every bias           as at d0            lr
             (the shared form's head bias: a width-independent log-prior per group and channel, 0 at init)
    hidden   ternary U, V; binary B        as at d0 * m^-1/2   lr / m
    output   decoder weight                as at d0 * m^-1     lr / m

Public surface: ``base_shape``, ``engine_scales``, ``widen``, ``initialise``,
``param_groups``; ``python -m probformer.mup coord-check | neighbourhood``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from graphs.limits import is_real
from inference import MupScales

__all__ = ["PARADIGMS", "GROUPS", "base_shape", "engine_scales", "widen", "initialise", "param_groups", "roles"]

PARADIGMS = ("channels", "rank")
GROUPS = ("input", "hidden", "output")
_CONFIG_KEYS = ("labels", "channels", "rank", "global_labels", "mup_base_width", "mup_paradigm")


def _checked_config(config):
    """A Probabilistic Transformer's config (``PTConfig``): what every function of a config reads."""
    missing = [key for key in _CONFIG_KEYS if not hasattr(config, key)]
    if missing:
        hint = " (pass model.config)" if isinstance(config, torch.nn.Module) else ""
        raise TypeError(
            f"config must be a PTConfig (with {', '.join(_CONFIG_KEYS)}), got {type(config).__name__}{hint}"
        )
    return config


def _check_rate(name: str, value, minimum_included: bool) -> None:
    """A learning rate (> 0) or weight decay (>= 0): a finite real number, not a bool."""
    bound = ">= 0" if minimum_included else "> 0"
    number = is_real(value) and math.isfinite(value)
    if not number or not (value >= 0 if minimum_included else value > 0):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def _unwrap(model):
    """The user's module under DDP/FSDP (``.module``) or torch.compile (``._orig_mod``)."""
    if not isinstance(model, torch.nn.Module):
        hint = " (the model built from it)" if all(hasattr(model, key) for key in _CONFIG_KEYS) else ""
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}{hint}")
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def base_width(config) -> int:
    config = _checked_config(config)
    return config.mup_base_width or config.labels


def width_multiplier(config) -> float:
    return _checked_config(config).labels / base_width(config)


def base_shape(config) -> dict[str, float]:
    """Labels, channels, rank and global labels of the base model (floats: the base
    need not be buildable to define the scales)."""
    m = width_multiplier(config)  # checks config
    grows_channels = config.mup_paradigm == "channels"
    return {
        "labels": float(base_width(config)),
        "channels": config.channels / m if grows_channels else float(config.channels),
        "rank": float(config.rank) if grows_channels else config.rank / m,
        "global_labels": config.global_labels / m,  # global values grow with d (pt-spec.md §4.1)
    }


def engine_scales(config) -> MupScales:
    """The ``MeanField`` μP factors of ``config``, relative to its base width."""
    base = base_shape(config)  # checks config
    here = MupScales.at(config.labels, config.rank, config.global_labels)
    return here.relative_to(MupScales.at(base["labels"], base["rank"], base["global_labels"]))


def widen(config, labels: int):
    """``config`` at width ``labels``: channels (or rank) and global labels scaled by the
    same factor, the base width kept, so hyper-parameters tuned at the base transfer."""
    if isinstance(labels, bool) or not isinstance(labels, int) or labels < 1:
        raise ValueError(f"labels must be an integer >= 1, got {labels!r}")
    factor = labels / _checked_config(config).labels

    def scaled(name: str) -> int:
        value = getattr(config, name) * factor
        if abs(value - round(value)) > 1e-9 or round(value) < (0 if name == "global_labels" else 1):
            raise ValueError(
                f"widening {name}={getattr(config, name)} from labels={config.labels} to {labels} gives "
                f"{value:g}, not a positive integer; pick widths that divide evenly"
            )
        return round(value)

    grows = "channels" if config.mup_paradigm == "channels" else "rank"
    return dataclasses.replace(
        config,
        labels=labels,
        **{grows: scaled(grows)},
        global_labels=scaled("global_labels"),
        mup_base_width=base_width(config),
    )


# ---- parameters ---------------------------------------------------------------------


def roles(model) -> dict[str, str]:
    """Parameter name -> group. For the Probabilistic Transformer: the μP table above.
    For any other model (baselines, the Particle Transformer): weights with two or more
    dimensions are "hidden", vectors (biases, norms) "input" (standard groups)."""
    model = _unwrap(model)
    named = dict(model.named_parameters())  # shared tensors once (the PT's crf is in two places)
    if not hasattr(model, "crf"):
        return {name: "hidden" if p.ndim >= 2 else "input" for name, p in named.items()}
    table = {
        "crf.unary": "input",
        "crf.ternary_u": "hidden",
        "crf.ternary_v": "hidden",
        # the shared form: U, V as the low-rank form's; its head bias is added to head logits that μP
        # keeps O(1) at every width (engine scales), so, like any bias, it is width-independent
        "crf.shared_u": "hidden",
        "crf.shared_v": "hidden",
        "crf.shared_bias": "input",
        "crf.binary": "hidden",
        # the CP and Tucker forms of the ternary tensor (μP refuses them; standard groups)
        **{f"crf.{name}": "hidden" for name in ("cp_dependent", "cp_head", "cp_channel")},
        **{f"crf.{name}": "hidden" for name in ("tucker_dependent", "tucker_head", "tucker_core")},
        # options that μP refuses (standard groups): ACT's halting unit, spans, memory keys
        "mean_field.halting_unit.weight": "output",
        "mean_field.halting_unit.bias": "input",
        "mean_field.span": "input",
        # the Pairwise label-label table of PTConfig(pairwise=...) [K, d, d]: its optimiser group
        # only (μP itself refuses pairwise: its role is not derived)
        "crf.factors.0.table": "hidden",
        "crf.memory_keys_first": "hidden",
        "crf.memory_keys_second": "hidden",
        "head.decoder.weight": "output",
        "head.decoder.bias": "input",
    }
    unknown = sorted(set(named) - set(table))
    if unknown:
        raise ValueError(f"no μP group for parameters {unknown}; known: {sorted(table)}")
    return {name: table[name] for name in named}


def _multipliers(model) -> dict[str, tuple[float, float]]:
    """Group -> (init std multiplier, learning-rate multiplier) for ``model``."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "mup", False):
        return {group: (1.0, 1.0) for group in GROUPS}
    m = width_multiplier(config)
    return {"input": (1.0, 1.0), "hidden": (m**-0.5, 1 / m), "output": (1 / m, 1 / m)}


def _standard_std(name: str, shape, config) -> float:
    """The standard initialisation's std for parameter ``name`` of a model whose width
    is ``config.labels`` (the CRF's and ``nn.Linear``'s defaults), as a function of shape,
    so it can be evaluated at the base width."""
    d, r = shape["labels"], shape["rank"]
    if name == "crf.unary":  # xavier-uniform on [V, d]
        return math.sqrt(2.0 / (config.vocab_size + d))
    if name in ("crf.ternary_u", "crf.ternary_v", "crf.shared_u", "crf.shared_v"):  # N(0, 1/r)
        return r**-0.5
    if name == "crf.shared_bias":  # zeros at every width
        return 0.0
    if name == "crf.binary":  # N(0, 1/d)
        return d**-0.5
    if name in ("head.decoder.weight", "head.decoder.bias"):  # nn.Linear: U(+-1/sqrt(fan_in))
        return (3 * d) ** -0.5
    raise ValueError(f"no standard initialisation known for {name!r}")


@torch.no_grad()
def initialise(model) -> None:
    """Rescale the standard initialisation in place to μP's: each parameter's std becomes
    the standard std *at the base width* times its group's multiplier. At the base width
    every factor is 1 (parameters unchanged); a no-op for models with ``mup=False``."""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "mup", False) or not hasattr(model, "crf"):
        return
    here = {"labels": float(config.labels), "rank": float(config.rank)}
    base = base_shape(config)
    multipliers = _multipliers(model)
    role_of = roles(model)
    for name, parameter in model.named_parameters():
        group = role_of[name]
        standard = _standard_std(name, here, config)
        if standard == 0.0:  # initialised to zero: zero at every width
            continue
        target = _standard_std(name, base, config) * multipliers[group][0]
        parameter.mul_(target / standard)


def param_groups(model, lr: float, weight_decay: float = 0.0) -> list[dict]:
    """AdamW parameter groups: one per (μP group, decayed or not). Every parameter is in
    exactly one group; each group carries ``name`` and ``lr_multiplier``. Biases (every
    parameter named ``*bias``, vectors or not) and norms get no weight decay. Works through
    DDP/FSDP/compile wrappers."""
    _check_rate("lr", lr, minimum_included=False)
    _check_rate("weight_decay", weight_decay, minimum_included=True)
    inner = _unwrap(model)
    role_of = roles(inner)
    multipliers = _multipliers(inner)
    groups: dict[tuple[str, bool], dict] = {}
    for name, parameter in inner.named_parameters():
        if not parameter.requires_grad:
            continue
        # a bias is never decayed: the vectors, and the shared form's [K, C] head bias
        group, decayed = role_of[name], parameter.ndim >= 2 and not name.endswith("bias")
        key = (group, decayed)
        if key not in groups:
            groups[key] = {
                "name": f"{group}{'' if decayed else '/no_decay'}",
                "params": [],
                "param_names": [],
                "lr": lr * multipliers[group][1],
                "lr_multiplier": multipliers[group][1],
                "weight_decay": weight_decay if decayed else 0.0,
            }
        groups[key]["params"].append(parameter)
        groups[key]["param_names"].append(name)
    return [groups[k] for k in sorted(groups)]
