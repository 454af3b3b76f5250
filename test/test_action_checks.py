"""ActionCheck's fast pass (numpy, for CPU batches that pass) agrees with its torch pass
(``_checked``, which also says what is wrong) on every spec kind, dtype and value tried."""
from __future__ import annotations

import itertools

import pytest
import torch
from torchrl.data import Binary, Bounded, Categorical, OneHot, Unbounded

from torchrl_asyncpool.collector.action_checks import ActionCheck, InvalidActionError

SPECS = [
    ("categorical", torch.int64, Categorical(3)),
    ("categorical_int32", torch.int32, Categorical(5, dtype=torch.int32)),
    ("binary", torch.int64, Binary(2, dtype=torch.int64)),
    ("onehot", torch.int64, OneHot(3, dtype=torch.int64)),
    ("int_box", torch.int64, Bounded(-2, 3, shape=(2,), dtype=torch.int64)),
    ("uint8_no_spec", torch.uint8, None),
    ("int64_no_spec", torch.int64, None),
    ("int16_unbounded", torch.int16, Unbounded((), dtype=torch.int16)),
    ("bool", torch.bool, Binary(1, dtype=torch.bool)),
    ("float", torch.float32, Bounded(-1.0, 1.0, shape=(2,))),
]

VALUES = [
    torch.tensor([0, 1, 2]),
    torch.tensor([0, 3]),
    torch.tensor([-1, 0]),
    torch.tensor([[0, 1, 0], [1, 0, 0]]),
    torch.tensor([[0, 1, 1], [0, 0, 0]]),
    torch.tensor([[-2, 3], [0, 1]]),
    torch.tensor([[-3, 0]]),
    torch.tensor([0, 1], dtype=torch.int32),
    torch.tensor([0, 7], dtype=torch.int32),
    torch.tensor([0, 1], dtype=torch.int8),
    torch.tensor([-1, 1], dtype=torch.int8),
    torch.tensor([0, 255], dtype=torch.uint8),
    torch.tensor([True, False]),
    torch.tensor([0, 2**40]),
    torch.tensor([0.0, 2.0]),
    torch.tensor([0.0, 2.5]),
    torch.tensor([float("nan"), 1.0]),
    torch.tensor([[0.0, 1.0, 0.0]]),
    torch.tensor([[0.5, -0.5]], dtype=torch.float64),
    torch.tensor([float("inf"), 0.0]),
    torch.tensor([[float("-inf"), float("inf")]]),
    torch.tensor([[60000.0, 60000.0]], dtype=torch.float16),  # a finite batch whose sum overflows
    torch.tensor([[0.5, 1.5]], dtype=torch.bfloat16),
]


def _outcome(fn, value):
    try:
        out = fn(value)
    except InvalidActionError as err:
        return ("error", err.rows.tolist())
    return ("ok", out.dtype, out.tolist())


@pytest.mark.parametrize("cast,bounds", list(itertools.product([False, True], [True, False])))
@pytest.mark.parametrize("name,dtype,spec", SPECS, ids=[s[0] for s in SPECS])
def test_fast_pass_agrees_with_the_torch_pass(name, dtype, spec, cast, bounds):
    check = ActionCheck("action", dtype, spec, cast=cast, bounds=bounds)
    for value in VALUES:
        if spec is not None and tuple(value.shape[1:]) != tuple(spec.shape):
            continue  # a wrong shape is refused where the actions are written into the slots
        assert _outcome(check, value) == _outcome(check._checked, value), (name, value)


def test_values_the_fast_pass_cannot_read_are_checked_in_torch():
    check = ActionCheck("action", torch.int64, Categorical(3))
    # a value that requires grad and a dtype numpy lacks: the torch pass, same rules
    with pytest.raises(InvalidActionError, match="fractional"):
        check(torch.tensor([0.5, 1.0], requires_grad=True))
    assert check(torch.tensor([1.0, 2.0], dtype=torch.bfloat16)).tolist() == [1, 2]
    with pytest.raises(InvalidActionError, match="outside the Categorical"):
        check(torch.tensor([1.0, 3.0], dtype=torch.bfloat16))
    value = torch.tensor([2, 0])
    assert check(value) is value  # the slot's dtype already: the same tensor, not a copy


def test_action_indices_for_a_onehot_spec_are_refused_with_the_encoding_fix():
    # GymEnv's default encoding makes CartPole's Discrete(2) a OneHot spec: a policy writing the
    # index (an argmax) is told which env option or conversion fits it
    check = ActionCheck("action", torch.int64, OneHot(2, dtype=torch.int64))
    with pytest.raises(InvalidActionError, match=r"one-hot rows of 2: .*categorical_action_encoding=True"):
        check(torch.tensor([1, 0]))  # a batch of 2 indices
    assert check(torch.tensor([[0, 1], [1, 0]])).tolist() == [[0, 1], [1, 0]]
