"""Inputs to the loaded models' wrappers, in every format: wrong dtypes are a ``TypeError``,
wrong shapes, out-of-range ids, empty rows and over-long inputs a ``ValueError``; any input
hypothesis makes gets the source model's logits or one of those two errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from probformer.deploy import reader
from tests.probformer.deploy.reader.artefacts import HYPOTHESIS, VOCAB, expected_logits

INPUT_CASES = {
    "float tokens": (torch.zeros(2, 3), None),
    "bool tokens": (torch.ones(2, 3, dtype=torch.bool), None),
    "rank 1": (torch.zeros(3, dtype=torch.long), None),
    "rank 3": (torch.zeros(1, 2, 3, dtype=torch.long), None),
    "int mask": (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)),
    "mask shape": (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)),
    "id too large": (torch.full((2, 3), VOCAB, dtype=torch.long), None),
    "negative id": (torch.full((2, 3), -1, dtype=torch.long), None),
    "empty row": (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool)),
    "too long": (torch.zeros(1, 21, dtype=torch.long), None),
    "empty": (torch.zeros(0, 3, dtype=torch.long), None),
    "numpy": (torch.zeros(2, 3, dtype=torch.long).numpy(), None),
}


@pytest.fixture(scope="module")
def loaded(artefacts):
    return {fmt: reader.load(path) for fmt, path in artefacts.items()}


@pytest.mark.parametrize("fmt", ["folder", "pt2", "onnx"])
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_wrappers_refuse_bad_inputs(loaded, fmt, case):
    tokens, mask = INPUT_CASES[case]
    wrong_type = case in ("float tokens", "bool tokens", "int mask", "numpy")  # TypeError; the rest ValueError
    with pytest.raises(TypeError if wrong_type else ValueError):
        loaded[fmt](tokens, mask)


@HYPOTHESIS
@given(
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    low=st.integers(-3, VOCAB),
    masked=st.booleans(),
)
def test_wrappers_answer_any_input_with_logits_or_value_error(loaded, model, dtype, shape, low, masked):
    """Oracle: the source model's logits where the input is valid, else TypeError (a float
    or bool dtype) or ValueError."""
    tokens = torch.full(shape, low).to(dtype)
    mask = (torch.rand(shape) > 0.3) if masked else None
    for fmt in ("pt2", "onnx"):
        try:
            found = loaded[fmt](tokens, mask)
        except TypeError:
            assert dtype in (torch.float32, torch.bool)
            continue
        except ValueError:
            continue
        with torch.no_grad():
            expected = expected_logits(model, tokens, mask)
        assert torch.allclose(found, expected, atol=1e-5)
