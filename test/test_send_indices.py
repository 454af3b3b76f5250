"""``send``'s env indices: integers only, 1-D, and a ``ValueError`` that names what was given."""
import numpy as np
import pytest
import torch

from conftest import oracle_factories
from torchrl_asyncpool import AsyncEnvPool
from torchrl_asyncpool.exchange.consumer import as_index
from torchrl_asyncpool.testing.oracle_env import oracle_action


@pytest.mark.parametrize("given", [
    [0, 2], (0, 2), range(0, 3, 2), [np.int64(0), np.int32(2)], torch.tensor([0, 2]),
    torch.tensor([0, 2], dtype=torch.int32), np.array([0, 2]), np.array([0, 2], dtype=np.uint8),
    list(torch.tensor([0, 2])),  # the elements of an integer tensor
])
def test_integer_indices_are_accepted(given):
    idx = as_index(given, 4)
    assert idx.dtype == torch.int64 and idx.tolist() == [0, 2]


@pytest.mark.parametrize("given,named", [
    ([1.5, 0.2], "float 1.5 at position 0"),  # was truncated to envs 1 and 0
    ([0, 1.0], "float 1.0 at position 1"),
    (torch.tensor([[0, 1], [2, 3]]), "2-D tensor"),  # was flattened
    (torch.tensor(1), "0-D tensor"),
    (np.array([[0], [1]]), "2-D array"),
    (torch.tensor([0.0, 1.0]), "dtype torch.float32"),
    (np.array([0.0]), "dtype float64"),
    (torch.tensor([True, False]), "dtype torch.bool"),
    ([True], "bool True"),
    (None, "NoneType None"),
    (["0"], "str '0'"),
    ("01", "str '01'"),
    (3, "int 3"),
    ({0: 1}, "dict"),
    ([None], "NoneType None at position 0"),
])
def test_anything_else_is_a_value_error_naming_it(given, named):
    with pytest.raises(ValueError, match="env_indices must be Python ints or a 1-D integer tensor") as info:
        as_index(given, 4)
    assert named in str(info.value)


def test_a_pool_refuses_float_indices_and_stays_usable():
    with AsyncEnvPool(oracle_factories(2)) as pool:
        td = pool.recv(min_get=2)
        order = td.env_indices.tolist()
        action = {"action": oracle_action(td["tag"])}
        with pytest.raises(ValueError, match=r"got float [01]\.0 at position 0"):
            pool.send(action, [float(i) for i in order])
        pool.send(action, order)  # nothing was written by the refused call
        assert pool.recv(min_get=2).batch_size[0] == 2
