"""The serving thread's direct call of a plain TensorDictModule (collector/direct_call.py): the
same TensorDict as ``module(td)`` whenever it is used, and ``module(td)`` whenever it may not be."""
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, set_skip_existing
from torch import nn

from torchrl_asyncpool.collector.acting_policy import ActingPolicy
from torchrl_asyncpool.collector.direct_call import direct_call


def _batch(b=5):
    g = torch.Generator().manual_seed(0)
    return TensorDict({"observation": torch.randn(b, 4, generator=g), "env_index": torch.arange(b)}, [b])


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, obs):
        logits = self.lin(obs)
        return logits, logits.argmax(-1)


class _DictOut(nn.Module):
    def forward(self, obs):
        return {"action": obs.sum(-1), "extra": obs[:, :1]}


def _modules():
    torch.manual_seed(0)
    return {
        "linear": TensorDictModule(nn.Linear(4, 2), ["observation"], ["action"]),
        "two_outputs": TensorDictModule(_TwoHeads(), ["observation"], ["logits", "action"]),
        "nested_out": TensorDictModule(_TwoHeads(), ["observation"], [("agent", "logits"), "action"]),
        "ignored_output": TensorDictModule(_TwoHeads(), ["observation"], ["_", "action"]),
        "dict_output": TensorDictModule(_DictOut(), ["observation"], ["action", "extra"]),
        "two_inputs": TensorDictModule(lambda o, i: o[:, 0] + i, ["observation", "env_index"], ["action"]),
        "torchrl_actor": _torchrl_actor(),
    }


def _torchrl_actor():
    from torchrl.modules import Actor

    return Actor(nn.Linear(4, 2), in_keys=["observation"])


@pytest.mark.parametrize("name", list(_modules()))
def test_direct_call_writes_what_the_module_writes(name):
    module = _modules()[name]
    direct = direct_call(module)
    assert direct is not None and direct.applies()
    with torch.no_grad():
        want = module(_batch())
        got = direct(_batch())
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        torch.testing.assert_close(got.get(key), want.get(key))
    assert got.batch_size == want.batch_size


def test_modules_with_their_own_call_path_are_called_as_modules():
    from torch.distributions import Categorical
    from torchrl.modules import ProbabilisticActor

    actor = ProbabilisticActor(
        TensorDictModule(nn.Linear(4, 2), ["observation"], ["logits"]), in_keys=["logits"],
        distribution_class=Categorical, return_log_prob=True,
    )
    assert direct_call(actor) is None  # a sequence that samples, with its own forward
    assert direct_call(TensorDictModule(nn.Linear(4, 2), {"input": "observation"}, ["action"])) is None  # kwargs
    assert direct_call(TensorDictModule(nn.Linear(4, 2), ["observation"], ["action"], inplace=False)) is None
    assert direct_call(lambda td: td) is None

    class Custom(TensorDictModule):
        def forward(self, tensordict):
            return super().forward(tensordict).set("custom", torch.ones(tensordict.shape))

    assert direct_call(Custom(nn.Linear(4, 2), ["observation"], ["action"])) is None


def test_hooks_and_skip_existing_send_the_call_through_the_module():
    module = TensorDictModule(nn.Linear(4, 2), ["observation"], ["action"])
    direct = direct_call(module)
    handle = module.register_forward_hook(lambda m, args, out: out.set("hooked", torch.ones(out.shape)))
    assert not direct.applies()
    handle.remove()
    assert direct.applies()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
    try:
        assert not direct.applies()
    finally:
        handle.remove()
    with set_skip_existing(True):
        assert not direct.applies()
    assert direct.applies()
    module.select_out_keys("action")  # a hook of its own
    assert not direct.applies()


def test_the_acting_policy_honours_a_hook_added_after_it_was_built():
    module = TensorDictModule(nn.Linear(4, 2), ["observation"], ["action"])
    acting = ActingPolicy(module)
    assert "hooked" not in acting.forward(_batch()).keys()
    module.register_forward_hook(lambda m, args, out: out.set("hooked", torch.ones(out.shape)))
    assert "hooked" in acting.forward(_batch()).keys()


def test_a_swapped_inner_module_is_the_one_called():
    module = TensorDictModule(nn.Linear(4, 2), ["observation"], ["action"])
    acting = ActingPolicy(module)
    module.module = nn.Sequential(nn.Linear(4, 3))
    assert acting.forward(_batch()).get("action").shape == (5, 3)


def test_wrong_outputs_fail_as_the_module_would():
    wrong_rows = TensorDictModule(lambda o: o[:2], ["observation"], ["action"])
    with pytest.raises(RuntimeError):
        wrong_rows(_batch())
    with pytest.raises(RuntimeError):  # td.set's own batch-size error
        direct_call(wrong_rows)(_batch())
    too_few = TensorDictModule(lambda o: o, ["observation"], ["action", "other"])
    with pytest.raises(RuntimeError, match="out_keys"):
        direct_call(too_few)(_batch())
    strict = TensorDictModule(lambda o: o, ["missing"], ["action"], strict=True)
    with pytest.raises(KeyError):
        direct_call(strict)(_batch())
