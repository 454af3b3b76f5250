"""SAC-style background collection is exact: ``collector.start()`` fills a TorchRL ``ReplayBuffer``
while the learner samples from it, pauses the collector (``with collector.pause():``) and ships new
weights, as ``sota-implementations/sac_mujoco.py`` does; when the collector is done, every
transition the oracle envs produced is in the buffer exactly once, in order per env, with the
right step types, and no minibatch the learner sampled meanwhile held a torn transition."""
import time

import pytest
import torch
import torch.nn as nn
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.testing import OracleChecker, oracle_action

from conftest import oracle_factories

_TOTAL = 3000
_MAX_EPISODE_LEN = 9


class _OraclePolicy(nn.Module):
    """Acts as the oracle expects; its one weight is what the learner trains and ships."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, td):
        return td.set("action", oracle_action(td["tag"]))


class _FrameCount:
    """The collector's ``post_collect_hook``, as the SAC script counts its frames."""

    def __init__(self):
        self.frames = 0

    def __call__(self, batch):
        self.frames += batch.numel()


def _check_sample(sample) -> None:
    """Every sampled transition is whole: its next tag continues its tag, its action answers it."""
    tag, nxt = sample["tag"], sample["next", "tag"]
    assert (tag[:, 0] == nxt[:, 0]).all() and (tag[:, 1] == nxt[:, 1]).all()
    assert (nxt[:, 2] == tag[:, 2] + 1).all()  # the oracle's next tag is the step after, also at an episode end
    assert torch.equal(sample["action"].reshape(-1), oracle_action(tag))


def test_sac_loop_on_the_oracle_fills_the_buffer_exactly_while_the_learner_samples(dev_shm_guard):
    rb = ReplayBuffer(storage=LazyTensorStorage(_TOTAL), batch_size=64)
    hook = _FrameCount()
    learner = _OraclePolicy()
    collector = AsyncPoolCollector(oracle_factories(4, max_episode_len=_MAX_EPISODE_LEN, step_delay=0.0005),
                                   policy=_OraclePolicy(), frames_per_batch=100, total_frames=_TOTAL,
                                   replay_buffer=rb, post_collect_hook=hook, transition_chunk_size=10)
    samples = pauses = 0
    try:
        collector.start()
        deadline = time.monotonic() + 120
        while len(rb) < _TOTAL:
            assert time.monotonic() < deadline, f"the buffer holds {len(rb)} of {_TOTAL} transitions after 120 s"
            collector.check_errors()
            if not len(rb):
                time.sleep(0.001)  # the learner waits for its first data
                continue
            _check_sample(rb.sample())  # sampled while the collector's thread writes
            samples += 1
            if samples % 10 == 0:  # a "gradient step": new weights, a new policy version
                with torch.no_grad():
                    learner.weight += 1
                collector.update_policy_weights_(learner.state_dict())
            if samples % 25 == 0:  # the learner fell behind: the envs stop while it catches up
                with collector.pause():
                    pauses += 1
                    held = len(rb)
                    _check_sample(rb.sample())
                    time.sleep(0.01)
                    assert len(rb) == held  # nothing is written while paused
        collector._replay_thread.join(30)  # total_frames reached: the background writer ends
        assert not collector._replay_thread.is_alive()
        collector.check_errors()
    finally:
        collector.shutdown()
    assert samples > 0 and pauses > 0
    assert len(rb) == _TOTAL and hook.frames == _TOTAL
    data = rb[:_TOTAL]  # storage order = delivery order
    checker = OracleChecker(max_episode_len=_MAX_EPISODE_LEN)
    checker.observe_transitions(data)  # exactly once, in order per env, right done/terminated/truncated
    assert checker.records == _TOTAL
    for env in range(4):
        versions = data["policy_version"][data["env_index"] == env].reshape(-1)
        assert versions.numel() and (versions.diff() >= 0).all()  # each env acted on ever newer weights
    assert int(data["policy_version"].max()) > 0


def test_a_policy_failing_in_background_collection_is_named_by_check_errors_and_shutdown(dev_shm_guard):
    """The writer thread of start() stops on the policy's error; check_errors() (the learner's
    poll) and shutdown() raise a RuntimeError whose message carries the cause, chained to it."""
    from torchrl_asyncpool.testing.policies import RaisingPolicy

    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    collector = AsyncPoolCollector(oracle_factories(2, max_episode_len=50), policy=RaisingPolicy(fail_at_step=20),
                                   frames_per_batch=8, total_frames=-1, replay_buffer=rb)
    try:
        collector.start()
        deadline = time.monotonic() + 60
        while collector._replay_error is None:
            assert time.monotonic() < deadline, "the failing policy did not stop the background collection"
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="scripted failure on a record at step") as info:
            collector.check_errors()
        assert "Background replay collection failed: InferenceServerError: policy" in str(info.value)
        assert "RaisingPolicy" in str(info.value.__cause__)
    finally:
        with pytest.raises(RuntimeError, match="scripted failure"):
            collector.shutdown()
