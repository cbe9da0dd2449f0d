"""What every config shares: validated integer keys, ``from_dict`` that rejects
unknown keys and values of the wrong type (naming the key), ``to_dict`` for
checkpoints, and the size limits (``LIMITS``, ``MAX_PARAMETERS``, ``MAX_FLOAT``) that
every config enforces before a model is built."""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import MISSING, asdict, fields

import torch

from graphs import crf as crfs
from graphs import topology as topologies

__all__ = ["ConfigMixin", "ALIASES", "LIMITS", "MAX_FLOAT", "MAX_PARAMETERS"]

# Names a transformer user knows (Hugging Face's), each standing for the first of its
# canonical keys that a config class has (docs/models.md has the table). Only canonical
# names are stored; an alias and its canonical key given together are refused. The PT's
# ``labels`` is its width d (the label values of each token's variable), not task labels.
ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("labels", "width"),
    "num_heads": ("channels", "heads"),
    "head_dim": ("rank",),  # the PT's per-channel rank r; a baseline's head width is width / heads
    "num_layers": ("iterations", "layers"),  # the PT's layers are its T weight-tied iterations
    "intermediate_size": ("ffn_width",),
}

# The most each integer key may be (sizes whose memory or time would be absurd are
# refused before anything is allocated). Generous: each is far beyond any model or run we
# train, and finite. A key that is not listed may be at most DEFAULT_LIMIT.
LIMITS: dict[str, int] = {
    # the CRF's sizes (vocab_size, labels, channels, rank, global_labels, gamma, ternary_blocks):
    # graphs.crf.LIMITS is the one table, which graphs.CRF itself enforces
    **crfs.LIMITS,
    # vocabularies and outputs: rows of an embedding or a decoder
    "num_classes": 2**24,
    "vocabulary": 2**24,  # data.vocabulary
    # widths
    "width": 2**16,
    "mup_base_width": 2**16,
    "ffn_width": 2**18,
    "memory_topk": 2**16,
    "pairwise_gamma": 2**12,  # graphs.factors.Pairwise's own limit
    # heads, channels, depth
    "heads": 2**10,
    "layers": 2**10,
    "local_layers": 2**10,
    "global_layers": 2**10,
    "local_rounds": 2**6,
    "iterations": 10_000,  # inference.MeanField's own limit
    "resample_every": 2**10,
    # lengths and distances
    "max_length": 2**20,
    "segment": 2**16,
    "window": 2**20,
    "span_max": 2**20,
    "span_ramp": 2**20,
    "clusters": 2**14,  # graphs.topology.clusters' own limit
    # training (probformer.training.run_config)
    "seed": 2**63 - 1,
    "batch_size": 2**20,
    "epochs": 10**6,
    "steps": 2**40,
    "warmup_steps": 2**40,
    "eval_every": 2**40,
    "eval_sentences": 2**31,
    "patience": 2**40,
    "checkpoint_every": 2**40,
    "log_every": 2**40,
    "diagnostics_every": 2**40,
    "threads": 2**12,
    "train_sentences": 2**31,
    "valid_sentences": 2**31,
}
DEFAULT_LIMIT = 2**31
MAX_FLOAT = 1e6  # every number-valued key (and every number in a dict key) is finite, |x| <= this
MAX_PARAMETERS = 2**31  # the estimated parameter count (estimated_parameters): 8 GiB of float32


class _AliasedConstructor(type):
    """Lets ``Config(hidden_size=64)`` mean ``Config(labels=64)``: the dataclass's own
    ``__init__`` sees canonical names only, so every check runs on them."""

    def __call__(cls, *args, **kwargs):
        return super().__call__(*args, **cls.canonical_keys(kwargs))


class ConfigMixin(metaclass=_AliasedConstructor):
    """Config dataclasses inherit this. Each subclass's ``__post_init__`` is wrapped so that,
    whatever the subclass checks itself, the config first refuses

    - a value not of its key's annotated type (``check_types``: bool keys take only True or
      False, int keys no bool, float keys an int too, ``X | None`` None);
    - an integer key above its maximum in ``LIMITS`` (``DEFAULT_LIMIT`` if unlisted):
      vocab_size, num_classes, vocabulary 2**24; width, labels, mup_base_width 2**16;
      ffn_width 2**18; rank 2**14; global_labels 2**20; memory_topk 2**16; heads,
      channels, layers, local_layers, global_layers, ternary_blocks, resample_every 2**10;
      local_rounds 64; iterations 10000; max_length, window, span_max, span_ramp 2**20;
      segment 2**16; gamma 4096; clusters 2**14; training: batch_size 2**20, epochs
      10**6, steps and the *_every / warmup counts 2**40, threads 4096, seed 2**63 - 1;
    - a number-valued key (dropout, temperature, jitter, lr, ...; the items of a dict
      key such as ``weights``, which must be ints or floats, never text or bools) that is
      NaN, infinite or larger than ``MAX_FLOAT`` = 1e6 in magnitude;
    - a ``topology`` whose arguments exceed ``graphs.topology``'s limits (clusters k <=
      2**14, window w and segments l <= 2**20);
    - a ``dropout`` outside [0, 1), in every config that has one;

    and, after the subclass's own checks, a config whose estimated parameter count
    (``estimated_parameters``) exceeds ``MAX_PARAMETERS`` = 2**31. Each error names the key
    and the limit. Nothing is allocated: these run on the config's numbers alone.

    The constructor and ``from_dict`` also take the ``ALIASES`` that apply to the class
    (``hidden_size`` for ``labels`` or ``width``, ...), and ``config.hidden_size`` reads
    and writes the canonical key; ``to_dict`` gives canonical names only.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None:
            if hasattr(cls, "__post_init__"):  # inherited from a config class: already wrapped
                return

            def own(self):
                return None

        elif getattr(own, "checks_limits", False):
            return

        def __post_init__(self):
            if any(f.name == "topology" for f in fields(self)):
                self.topology = stored_topology(self.topology)
            self.check_types()
            self.check_limits()
            if any(f.name == "dropout" for f in fields(self)):
                self.check_dropout()
            own(self)
            self.check_size()

        __post_init__.checks_limits = True
        __post_init__.__doc__ = own.__doc__
        cls.__post_init__ = __post_init__

    def check_types(self) -> None:
        """Every key's value of its annotated type (as ``from_dict`` checks), so a config built
        directly refuses ``aligned_training=None`` or ``act_epsilon='0.1'`` naming the key,
        before any comparison: bool keys take only bools, int keys refuse bools, float keys
        take ints, ``X | None`` takes None."""
        hints = _type_hints(type(self))
        for f in fields(self):
            value, hint = getattr(self, f.name), hints[f.name]
            if not _matches(value, hint):
                raise TypeError(
                    f"config key {f.name!r} must be of type {_describe(hint)}, got {type(value).__name__} {value!r}"
                )

    def check_limits(self) -> None:
        """Every integer key within ``LIMITS``, every number finite and within ``MAX_FLOAT``.
        Runs after ``check_types``: every value has its annotated type."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if isinstance(value, int):
                limit = LIMITS.get(f.name, DEFAULT_LIMIT)
                if value > limit:
                    raise ValueError(f"config key {f.name!r} must be <= {limit} (the limit), got {value!r}")
            elif isinstance(value, float):
                _check_float(f.name, value)
            elif f.name == "topology" and isinstance(value, str | dict):
                _check_topology(value)
            elif isinstance(value, dict):
                for key, item in value.items():
                    # the items are multipliers: text such as "1e400" or a bool that float()
                    # would turn into a number is refused, not read as one
                    if not isinstance(item, int | float) or isinstance(item, bool):
                        raise TypeError(
                            f"config key '{f.name}.{key}' must be a real number (an int or float, not a bool "
                            f"or text), got {type(item).__name__} {item!r}"
                        )
                    _check_float(f"{f.name}.{key}", float(item))

    def estimated_parameters(self) -> int:
        """An estimate of the parameters of the model this config builds, from the keys it
        has: embeddings and decoder (vocab_size or num_classes rows), positions, attention
        blocks (4 w^2 + 2 w f each), cluster keys, the PT's ternary tables (2 (gamma + 1) + 1
        groups of channels x labels x rank, twice; one group for the "shared" form) and global
        labels. Within ~10% of the real count for every model kind; above it for the smaller CP
        and Tucker forms."""
        get = {f.name: getattr(self, f.name) for f in fields(self)}

        def number(name: str) -> int:
            value = get.get(name, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        width = max(number("width"), number("labels"))
        outputs = number("vocab_size") if get.get("task", "mlm") == "mlm" else number("num_classes")
        # a SwarmFormer layer is its local blocks plus about one block of routing and clusters
        blocks = number("layers") * (number("local_rounds") + 1) + number("local_layers") + number("global_layers")
        gamma = get.get("gamma")
        groups = 2 * ((len(gamma) if isinstance(gamma, list) else number("gamma")) + 1) + 1
        projections = 1 if get.get("ternary_form") == "shared" else groups  # shared: one U, V for every group
        ternary = 2 * projections * number("channels") * number("labels") * number("rank")
        return (
            (number("vocab_size") + outputs + number("max_length") + number("segment")) * width
            + blocks * (4 * width * width + 2 * width * number("ffn_width"))
            + number("clusters") * width * max(1, number("layers"))
            + ternary
            + number("global_labels") * number("labels")
        )

    def check_size(self) -> None:
        estimate = self.estimated_parameters()
        if estimate > MAX_PARAMETERS:
            raise ValueError(
                f"config {type(self).__name__} would build about {estimate:,} parameters, more than the limit "
                f"{MAX_PARAMETERS:,} (2**31): reduce its sizes (vocab_size, width/labels, layers, ffn_width, ...)"
            )

    def check_integers(self, minimums: dict[str, int]) -> None:
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                kind = type(value).__name__
                raise TypeError(f"config key {name!r} must be an integer >= {minimum}, got {kind} {value!r}")
            if value < minimum:
                raise ValueError(f"config key {name!r} must be an integer >= {minimum}, got {value!r}")

    def check_flags(self, *names: str) -> None:
        for name in names:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"config key {name!r} must be true or false, got {getattr(self, name)!r}")

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
        self.check_num_classes()

    def check_num_classes(self) -> None:
        """``num_classes``: at least 1 for a task with classes; 0 for mlm, whose outputs are
        the vocabulary (a count given there would be ignored)."""
        if self.task != "mlm" and self.num_classes < 1:
            raise ValueError(f"config key 'num_classes' must be >= 1 for task {self.task!r}")
        if self.task == "mlm" and self.num_classes:
            raise ValueError(
                f"config key 'num_classes' ({self.num_classes}) is for the 'tagging' and 'classification' tasks; "
                "task 'mlm' predicts the vocabulary: leave it 0"
            )

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """``{alias: canonical key}`` for the ``ALIASES`` that apply to this class."""
        return _aliases(cls)

    @classmethod
    def canonical_keys(cls, values: dict, section: str = "") -> dict:
        """``values`` with every alias renamed to its canonical key; ``ValueError`` naming
        both when an alias and its canonical key (or two aliases of one key) are given."""
        prefix = f"{section}." if section else ""
        aliases, renamed = _aliases(cls), {}
        for name, value in values.items():
            canonical = aliases.get(name, name)
            if canonical in renamed:
                given = sorted(k for k in values if aliases.get(k, k) == canonical)
                raise ValueError(
                    f"config keys {[prefix + k for k in given]} name the same setting "
                    f"({prefix + canonical}; {', '.join(k for k in given if k != canonical)} is its alias): give one"
                )
            renamed[canonical] = value
        return renamed

    def __getattr__(self, name: str):
        # only reached for names that are not attributes: an alias reads its canonical key
        canonical = _aliases(type(self)).get(name)
        if canonical is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self, canonical)

    def __setattr__(self, name: str, value) -> None:
        # ``config.hidden_size = 64`` sets ``labels``, never a stray attribute the model ignores
        super().__setattr__(_aliases(type(self)).get(name, name), value)

    @classmethod
    def from_dict(cls, values: dict, section: str = ""):
        """Build from a plain dict (JSON, TOML); ``section`` prefixes key names in errors.
        Takes the class's aliases (``hidden_size``, ...) for their canonical keys."""
        prefix = f"{section}." if section else ""
        if not isinstance(values, dict):
            raise TypeError(f"config section {section or '(top)'!r} must be a table, got {values!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known) - set(_aliases(cls)))
        if unknown:
            aliases = f" (or the aliases {_aliases(cls)})" if _aliases(cls) else ""
            raise ValueError(f"unknown config keys {[prefix + k for k in unknown]}; allowed: {sorted(known)}{aliases}")
        canonical = cls.canonical_keys(values, section)
        missing = [name for name, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in missing if name not in canonical]
        if missing:
            raise ValueError(f"config keys {[prefix + k for k in missing]} are required")
        hints, aliases = _type_hints(cls), _aliases(cls)
        for name, value in values.items():  # named as the file has it (an alias or not)
            hint = hints[aliases.get(name, name)]
            if not _matches(value, hint):
                raise TypeError(
                    f"config key {prefix + name!r} must be of type {_describe(hint)}, "
                    f"got {type(value).__name__} {value!r}"
                )
        return cls(**canonical)

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache
def _aliases(cls) -> dict[str, str]:
    """The aliases of ``cls``: each ``ALIASES`` entry whose canonical keys include one of
    its fields (the first such), unless the alias is itself a field."""
    names = {f.name for f in fields(cls)}
    found = {}
    for alias, targets in ALIASES.items():
        present = [target for target in targets if target in names]
        if present and alias not in names:
            found[alias] = present[0]
    return found


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


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


def _check_float(name: str, value: float) -> None:
    if not math.isfinite(value) or abs(value) > MAX_FLOAT:
        raise ValueError(
            f"config key {name!r} must be a finite number with |value| <= {MAX_FLOAT:g} (the limit), got {value!r}"
        )


def stored_topology(value):
    """A config's ``topology`` as it is stored (JSON): text for a built-in (``"window(2)"``),
    else ``Topology.to_data()``'s dict (the arc list of a networkx graph or a mask). A
    networkx ``DiGraph``, a bool mask or a ``graphs.Topology`` is turned into that data
    here, so checkpoints and exports restore it exactly; a topology with no stored form
    (built from a callable) is refused now, before anything is written."""
    graph_like = isinstance(value, torch.Tensor | topologies.Topology) or callable(value) or hasattr(value, "edges")
    if not graph_like:  # text, stored data (checked with the limits), or a wrong type (named by check_types)
        return value
    try:
        data = topologies.parse(value).to_data()
    except ValueError as error:
        raise ValueError(f"config key 'topology': {error}") from None
    return data["text"] if set(data) == {"text"} else data


def _check_topology(spec: str | dict) -> None:
    """A topology's arguments have their limits in ``graphs.topology`` (clusters, window,
    segments): parsing it checks them without building a mask."""
    try:
        topologies.parse(spec)
    except ValueError as error:
        raise ValueError(f"config key 'topology': {error}") from None
