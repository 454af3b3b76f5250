"""prepare_learner_process: a training script's process starts the same with either collector."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from torchrl_asyncpool.examples.learner_process import prepare_learner_process

_CHILD = """
import importlib.machinery, sys, torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl_asyncpool.examples.learner_process import prepare_learner_process
calls = []
real = importlib.machinery.PathFinder.find_spec
def counting(name, *a, **k):  # a search of every sys.path entry
    calls.append(name)
    return real(name, *a, **k)
importlib.machinery.PathFinder.find_spec = counting
module = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
td = TensorDict({"x": torch.zeros(4, 3)}, [4])
module(td)
before = calls.count("pandas")
print(prepare_learner_process(2), torch.get_num_threads())
calls.clear()
for _ in range(5):
    module(td)
print(before, sum(1 for c in calls if c == "pandas"), sys.modules["pandas"])
"""


@pytest.mark.skipif(importlib.util.find_spec("pandas") is not None, reason="pandas is installed: nothing is probed")
def test_the_module_probed_on_every_call_is_recorded_once_and_the_threads_set():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
    first, second = out.stdout.split("\n")[:2]
    assert first == "['pandas'] 2"
    probed_before, probed_after, entry = second.split()
    assert int(probed_before) >= 1  # a TensorDictModule call searched sys.path for pandas
    assert int(probed_after) == 0  # five calls later: answered from sys.modules, no search
    assert entry == "None"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_refused(bad):
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="num_threads must be an int >= 1"):
        prepare_learner_process(bad)
    assert torch.get_num_threads() == threads
