"""Sizes whose memory or time would be absurd are refused before anything is allocated:
every config key, topology argument and MeanField's iterations, each with an
error that names the argument and the limit. Each refusal must come back fast: a refusal
that took seconds would have allocated (or looped) first."""

import dataclasses
import math
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference
from graphs import topology
from probformer.models import config as configs
from probformer.models import registry
from probformer.training.run_config import DataConfig, RunConfig, TrainConfig

FAST = 0.5  # seconds: far above a check, far below building a 10**12-row embedding


CONFIGS = {kind: registry.classes(kind)[0] for kind in registry.KINDS} | {"data": DataConfig, "train": TrainConfig}


REQUIRED = {"vocab_size": 10}  # the model configs' one required key


def make(cls, **values):
    needed = {f.name: REQUIRED[f.name] for f in dataclasses.fields(cls) if f.name in REQUIRED}
    return cls(**(needed | values))


def refused_fast(build, *names, error_type=ValueError):
    start = time.perf_counter()
    with pytest.raises(error_type) as error:
        build()
    elapsed = time.perf_counter() - start
    assert elapsed < FAST, f"refusal took {elapsed:.2f} s"
    for name in names:
        assert name in str(error.value), (name, str(error.value))
    return str(error.value)


def int_keys(cls):
    return [f.name for f in dataclasses.fields(cls) if f.type in ("int", int)]


def number_keys(cls):
    return [f.name for f in dataclasses.fields(cls) if f.type in ("float", float, "int | float")]


INT_CASES = [(kind, key) for kind, cls in CONFIGS.items() for key in int_keys(cls)]


FLOAT_CASES = [(kind, key) for kind, cls in CONFIGS.items() for key in number_keys(cls)]


def test_every_integer_key_has_a_limit_in_the_table():
    missing = sorted({key for _, key in INT_CASES} - set(configs.LIMITS))
    assert not missing, f"keys without a limit in probformer.models.config.LIMITS: {missing}"
    assert all(isinstance(v, int) and v >= 1 for v in configs.LIMITS.values())


@pytest.mark.parametrize("kind,key", INT_CASES)
def test_an_integer_above_its_limit_is_refused_naming_the_key_and_the_limit(kind, key):
    limit = configs.LIMITS[key]
    message = refused_fast(lambda: make(CONFIGS[kind], **{key: limit + 1}), repr(key), str(limit))
    assert "limit" in message


@pytest.mark.parametrize("value", [10**12, 10**100])
@pytest.mark.parametrize("kind", [k for k in CONFIGS if "vocab_size" in int_keys(CONFIGS[k])])
def test_absurd_vocabularies_are_refused_through_from_dict_too(kind, value):
    refused_fast(lambda: CONFIGS[kind].from_dict({"vocab_size": value}), "'vocab_size'", "limit")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e30, -1e7])
@pytest.mark.parametrize("kind,key", FLOAT_CASES)
def test_non_finite_or_absurd_numbers_are_refused_naming_the_key(kind, key, value):
    refused_fast(lambda: make(CONFIGS[kind], **{key: value}), repr(key))


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e30])
def test_numbers_inside_a_dict_key_are_checked(value):
    pt_config = CONFIGS["probabilistic_transformer"]
    refused_fast(lambda: make(pt_config, weights={"head": value}), "'weights.head'")


WEIGHT_NAMES = [f.name for f in dataclasses.fields(inference.MessageWeights)]
NOT_A_NUMBER = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["1e400", "-inf", "nan", "0.5", "1"]),  # text a float() would have read
    st.booleans(),
    st.none(),
    st.lists(st.floats(), max_size=2),
)


@given(key=st.sampled_from(WEIGHT_NAMES), value=NOT_A_NUMBER)
def test_a_weight_that_is_not_a_number_is_refused_naming_it(key, value):
    """Oracle: a weight is a real number (int or float, never a bool); anything else, text
    that float() would read included, is refused as ``weights.<key>``."""
    pt_config = CONFIGS["probabilistic_transformer"]
    refused_fast(lambda: make(pt_config, weights={key: value}), f"'weights.{key}'", error_type=TypeError)


@given(key=st.sampled_from(WEIGHT_NAMES), value=st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6))
def test_a_finite_weight_within_the_limit_is_kept(key, value):
    config = make(CONFIGS["probabilistic_transformer"], weights={key: value})
    assert config.weights == {key: value}


@given(key=st.sampled_from(WEIGHT_NAMES), value=NOT_A_NUMBER)
def test_a_weight_in_a_run_config_is_named_in_its_table(key, value):
    """The CLI's message names the key as the TOML file has it: ``model.weights.<key>``."""
    tables = {"model": {"kind": "probabilistic_transformer", "weights": {key: value}}, "data": {"source": "ptb"}}
    refused_fast(lambda: RunConfig.from_dict(tables), f"'model.weights.{key}'", error_type=TypeError)


@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_dropout_takes_only_finite_values_in_range(value):
    cls = CONFIGS["transformer"]
    if math.isfinite(value) and 0 <= value < 1:
        assert make(cls, dropout=value).dropout == value
    else:
        refused_fast(lambda: make(cls, dropout=value), "'dropout'")


@pytest.mark.parametrize(
    "kind,values",
    [
        ("transformer", dict(vocab_size=2**24, width=1024, heads=8)),  # two 2**34-entry tables
        ("particle_transformer", dict(width=2**15, heads=8, layers=64, ffn_width=2**16)),
        ("swarmformer", dict(width=2**14, heads=8, layers=512, ffn_width=2**16)),
        ("folded_context", dict(width=2**16, heads=16, local_layers=2)),
        ("probabilistic_transformer", dict(labels=2**12, channels=2**10, rank=2**10)),  # ternary tables
    ],
)
def test_each_size_within_its_limit_but_a_model_too_large_is_refused(kind, values):
    refused_fast(lambda: make(CONFIGS[kind], **values), "parameters", f"{configs.MAX_PARAMETERS:,}")


@pytest.mark.parametrize("kind", list(registry.KINDS))
def test_the_parameter_estimate_is_close_to_the_real_count(kind):
    """Oracle: the model built on the meta device (nothing allocated) counts its parameters."""
    config_cls, model_cls = registry.classes(kind)
    config = make(config_cls, vocab_size=5000)
    with torch.device("meta"):
        real = sum(p.numel() for p in model_cls(config).parameters())
    assert 0.9 * real <= config.estimated_parameters() <= 1.1 * real


@pytest.mark.parametrize(
    "build,names",
    [
        (lambda: topology.clusters(10**12), ("number of clusters k", "16384")),
        (lambda: topology.clusters(topology.MAX_CLUSTERS + 1, dynamic=True), ("number of clusters k", "limit")),
        (lambda: topology.window(10**12), ("window width w", "limit")),
        (lambda: topology.segments(10**12), ("segment length l", "limit")),
        (lambda: topology.parse("window(1) | clusters(1000000000000)"), ("number of clusters k", "limit")),
        (lambda: topology.full().mask(10**9), ("sentence length n", "65536")),
        (lambda: topology.clusters(16).mask(2**16), ("sentence length n", "16 virtual nodes")),
        (lambda: topology.full().arcs(torch.ones(1, 2**16 + 1, dtype=torch.bool)), ("sentence length n",)),
    ],
)
def test_absurd_topologies_are_refused_before_a_mask_exists(build, names):
    refused_fast(build, *names)


def test_topologies_at_their_limits_are_built():
    assert topology.clusters(topology.MAX_CLUSTERS).extra_nodes == topology.MAX_CLUSTERS
    assert topology.window(topology.MAX_REACH).band == (topology.MAX_REACH, topology.MAX_REACH)
    assert topology.segments(topology.MAX_REACH).segment_length == topology.MAX_REACH


def test_a_config_with_an_absurd_topology_is_refused():
    pt_config = CONFIGS["probabilistic_transformer"]
    refused_fast(lambda: make(pt_config, topology="clusters(1000000000000)"), "number of clusters k", "limit")


@pytest.mark.parametrize("iterations", [10**9, 10_001])
def test_mean_field_refuses_absurd_iterations(iterations):
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=1)
    refused_fast(lambda: inference.MeanField(crf, iterations=iterations), "iterations", "10000")
    assert inference.MeanField(crf, iterations=10_000).iterations == 10_000
    pt_config = CONFIGS["probabilistic_transformer"]
    refused_fast(lambda: make(pt_config, iterations=iterations), "'iterations'", "10000")


def test_config_limits_read_the_crf_table():
    # one table: the CRF's own sizes are the configs' limits for the same keys
    crf_sizes = {"vocab_size": 2**24, "labels": 2**16, "channels": 2**10, "rank": 2**14}
    crf_sizes |= {"global_labels": 2**20, "gamma": 2**12, "ternary_blocks": 2**10}
    assert graphs.crf.LIMITS == crf_sizes
    assert {name: configs.LIMITS[name] for name in crf_sizes} == crf_sizes


# ---- value types of a config built directly (not through from_dict) -----------------------

# The oracle: which Python values each annotation (as written in the dataclass) takes.
TYPE_ORACLE = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "None": lambda v: v is None,
}


WRONG_TYPED = [None, "0.1", "yes", True, 2, 0.5, [1], {"a": 1}, b"1"]


def annotation_takes(annotation: str, value) -> bool:
    return any(TYPE_ORACLE[arm.strip()](value) for arm in annotation.split("|"))


@pytest.mark.parametrize("kind", list(CONFIGS))
@given(value=st.sampled_from(WRONG_TYPED), data=st.data())
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(kind, value, data):
    cls = CONFIGS[kind]
    key = data.draw(st.sampled_from([f for f in dataclasses.fields(cls) if not annotation_takes(f.type, value)]))
    message = refused_fast(
        lambda: make(cls, **{key.name: value}), f"config key {key.name!r} must be of type", error_type=TypeError
    )
    assert f"got {type(value).__name__} {value!r}" in message


@pytest.mark.parametrize(
    "kind,values,match",
    [  # the reliability benchmark's cases: a TypeError naming the key
        ("probabilistic_transformer", dict(aligned_training=None), "'aligned_training' must be of type bool"),
        ("probabilistic_transformer", dict(aligned_training="yes"), "'aligned_training' must be of type bool"),
        ("probabilistic_transformer", dict(topology=None), "'topology' must be of type str"),
        ("probabilistic_transformer", dict(act_epsilon="0.1"), "'act_epsilon' must be of type float"),
        ("particle_transformer", dict(jitter="0.1"), "'jitter' must be of type float"),
        ("particle_transformer", dict(temperature=None), "'temperature' must be of type float"),
        ("transformer", dict(vocab_size=True), "'vocab_size' must be of type int"),
    ],
)
def test_the_benchmark_type_cases_are_refused_naming_the_key(kind, values, match):
    refused_fast(lambda: make(CONFIGS[kind], **values), match, error_type=TypeError)


def test_float_keys_take_integers():
    config = make(CONFIGS["particle_transformer"], temperature=2, jitter=0, dropout=0)
    assert (config.temperature, config.jitter, config.dropout) == (2, 0, 0)


DROPOUT_KINDS = [kind for kind, cls in CONFIGS.items() if "dropout" in {f.name for f in dataclasses.fields(cls)}]


@pytest.mark.parametrize("kind", DROPOUT_KINDS)
@given(value=st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_every_config_dropout_lies_in_zero_one(kind, value):
    # PTConfig(dropout=-0.5) was accepted
    cls = CONFIGS[kind]
    if 0 <= value < 1:
        assert make(cls, dropout=value).dropout == value
    else:
        refused_fast(lambda: make(cls, dropout=value), "'dropout'")


def test_every_model_config_has_a_dropout():
    assert set(DROPOUT_KINDS) == set(registry.KINDS)


TASK_KINDS = [
    kind for kind, cls in CONFIGS.items() if {"task", "num_classes"} <= {f.name for f in dataclasses.fields(cls)}
]


@pytest.mark.parametrize("kind", TASK_KINDS)
@given(classes=st.integers(1, 50))
def test_a_class_count_with_the_mlm_task_is_refused_not_ignored(kind, classes):
    """Task mlm predicts the vocabulary: a num_classes given with it built a model with
    vocab_size outputs and no word said that the count was unused."""
    refused_fast(lambda: make(CONFIGS[kind], task="mlm", num_classes=classes), "num_classes", "mlm")
    assert make(CONFIGS[kind], task="tagging", num_classes=classes).num_classes == classes
