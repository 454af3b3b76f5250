"""Batches carry TorchRL's ("collector", "traj_ids") by default: one id per episode of one env,
carried from one batch to the next; ordered by them (by_trajectory), TorchRL's split_trajectories
and an advantage estimator after it see each env's transitions in order and never mix two envs.
With batch_layout="env_major" a batch is [num_envs, T] and TorchRL's GAE module is exact on it."""
import pytest
import torch
import torch.nn as nn
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import AsyncBatchedCollector
from torchrl.collectors.utils import split_trajectories
from torchrl.objectives.value import GAE
from torchrl.objectives.value.functional import generalized_advantage_estimate

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.collector.traj_ids import TrajectoryIds, by_trajectory, env_major
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action


def _oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def test_trajectory_ids_follow_episodes_across_batches_and_envs():
    ids = TrajectoryIds(3)
    first = ids(torch.tensor([2, 2, 0, 1, 2]), torch.tensor([False, True, False, False, False]))
    assert first.tolist() == [0, 0, 1, 2, 3]
    second = ids(torch.tensor([0, 2, 1, 1]), torch.tensor([True, False, True, False]))
    assert second.tolist() == [1, 3, 2, 4]  # each env's open episode goes on; env 1's next one is new


def test_every_episode_of_the_oracle_gets_one_id_and_split_trajectories_regroups_them():
    collector = AsyncPoolCollector([lambda i=i: OracleEnv(env_id=i, max_episode_len=5) for i in range(4)],
                                   policy=_oracle_policy, frames_per_batch=24, total_frames=24 * 12,
                                   )
    seen = {}  # traj id -> (env, episode)
    try:
        for batch in collector:
            ids = batch["collector", "traj_ids"]
            tags = batch["tag"]  # (env id, episode id, step id) of the observation each action answered
            for traj, tag in zip(ids.tolist(), tags.tolist()):
                assert seen.setdefault(traj, (tag[0], tag[1])) == (tag[0], tag[1])
            for traj in split_trajectories(by_trajectory(batch)).unbind(0):
                mask = traj["collector", "mask"]
                steps = traj["tag"][mask][:, 2]
                envs = traj["tag"][mask][:, 0]
                assert (envs == envs[0]).all()  # one env per trajectory
                assert (steps.diff() == 1).all()  # in order, nothing missing in between
    finally:
        collector.shutdown()
    assert len(set(seen.values())) == len(seen)  # never one episode under two ids


def test_gae_after_split_trajectories_equals_gae_per_env():
    collector = AsyncPoolCollector([lambda i=i: OracleEnv(env_id=i, max_episode_len=6) for i in range(3)],
                                   policy=_oracle_policy, frames_per_batch=60, total_frames=60,
                                   )
    try:
        batch = next(iter(collector)).clone()
    finally:
        collector.shutdown()
    n = batch.shape[0]
    value = torch.randn(n, 1)
    next_value = torch.randn(n, 1)
    batch["state_value"], batch["next", "state_value"] = value, next_value
    reward = torch.randn(n, 1)
    batch["next", "reward"] = reward
    batch["_row"] = torch.arange(n)
    # the reference: each env's transitions in time order, GAE along them
    expected = torch.empty(n, 1)
    for env in batch["env_index"].unique().tolist():
        rows = (batch["env_index"] == env).nonzero().squeeze(-1)
        adv, _ = generalized_advantage_estimate(0.99, 0.95, value[rows], next_value[rows], reward[rows],
                                                batch["next", "done"][rows], batch["next", "terminated"][rows])
        expected[rows] = adv
    # the TorchRL way: split the batch by trajectory (padded, with a mask), GAE along time
    trajs = split_trajectories(by_trajectory(batch))
    adv, _ = generalized_advantage_estimate(0.99, 0.95, trajs["state_value"], trajs["next", "state_value"],
                                            trajs["next", "reward"], trajs["next", "done"],
                                            trajs["next", "terminated"], time_dim=-2)
    mask = trajs["collector", "mask"]
    got = torch.empty(n, 1)
    got[trajs["_row"][mask]] = adv[mask]
    assert torch.allclose(got, expected, atol=1e-5)


def test_trajectory_ids_are_on_by_default_as_in_torchrl_collector_and_off_gives_async_batched_keys():
    import warnings

    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = AsyncBatchedCollector([OracleEnv] * 2, policy=OracleTagPolicy(), frames_per_batch=8, total_frames=8,
                                       env_backend="threading")
    try:
        their_keys = set(next(iter(theirs)).keys(True, True))
    finally:
        theirs.shutdown()
    for track, extra in ((True, {("collector", "traj_ids")}), (False, set())):
        collector = AsyncPoolCollector([OracleEnv] * 2, policy=_oracle_policy, frames_per_batch=8, total_frames=8,
                                       **({} if track else {"track_traj_ids": False}))
        try:
            assert set(next(iter(collector)).keys(True, True)) == their_keys | extra
        finally:
            collector.shutdown()


class _TagValue(nn.Module):
    """A value of the oracle's tag (with a bias: a zero padding row has a value of its own)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, tag):
        return self.net(tag.float() / 10)


def test_env_major_pads_each_env_row_on_the_left():
    batch = TensorDict({"env_index": torch.tensor([2, 2, 0, 2]), "x": torch.tensor([1, 2, 3, 4]),
                        ("collector", "traj_ids"): torch.tensor([5, 5, 6, 7])}, [4])
    out = env_major(batch, 3)
    assert out.shape == (3, 3) and out.names == [None, "time"]
    assert out["x"].tolist() == [[0, 0, 3], [0, 0, 0], [1, 2, 4]]
    assert out["collector", "traj_ids"].tolist() == [[-1, -1, 6], [-1, -1, -1], [5, 5, 7]]
    assert out["env_index"].tolist() == [[0] * 3, [1] * 3, [2] * 3]
    assert out[out["collector", "mask"]]["x"].tolist() == [3, 1, 2, 4]
    with pytest.raises(ValueError, match="num_envs is 2"):
        env_major(batch, 2)


def test_gae_module_on_an_env_major_batch_equals_gae_per_env_on_the_same_transitions():
    """TorchRL's GAE, with a value network, called on the batch as it comes (no regrouping): its
    advantages equal GAE computed env by env along each env's transitions in time order."""
    checker = OracleChecker(max_episode_len=9)
    value_net = TensorDictModule(_TagValue(), in_keys=["tag"], out_keys=["state_value"])
    gae = GAE(gamma=0.9, lmbda=0.8, value_network=value_net, average_gae=False)
    # env 0 steps ~8x faster than env 3 and each env may fill 4 chunks ahead: rows of unequal length
    collector = AsyncPoolCollector([lambda i=i: OracleEnv(env_id=i, max_episode_len=9, step_delay=0.001 * (1 + 2 * i))
                                    for i in range(4)], policy=_oracle_policy, frames_per_batch=48,
                                   total_frames=48 * 4, transition_chunk_size=3, chunks_per_env=4,
                                   batch_layout="env_major")
    padded = 0
    try:
        for batch in collector:
            assert batch.batch_size[0] == 4 and batch.names == [None, "time"]
            mask = batch["collector", "mask"]
            assert int(mask.sum()) == 48
            padded += int((~mask).sum())
            with torch.no_grad():
                gae(batch)
            real = batch[mask]
            checker.observe_transitions(real)  # exactly once, in order per env, right step types
            for env in range(4):
                rows = real[real["env_index"] == env]
                if not rows.numel():
                    continue
                with torch.no_grad():
                    value = value_net.module(rows["tag"])
                    next_value = value_net.module(rows["next", "tag"])
                expected, _ = generalized_advantage_estimate(0.9, 0.8, value, next_value, rows["next", "reward"],
                                                             rows["next", "done"], rows["next", "terminated"])
                torch.testing.assert_close(rows["advantage"], expected, atol=1e-5, rtol=1e-5)
    finally:
        collector.shutdown()
    assert collector._frames == 48 * 4
    assert padded > 0  # the padding was there, and reached no real advantage


def test_gae_module_on_a_flat_batch_would_carry_advantages_across_envs():
    """Why env_major exists: on the flat layout TorchRL's GAE runs along the row of chunks."""
    value_net = TensorDictModule(_TagValue(), in_keys=["tag"], out_keys=["state_value"])
    gae = GAE(gamma=0.9, lmbda=0.8, value_network=value_net, average_gae=False)
    collector = AsyncPoolCollector([lambda i=i: OracleEnv(env_id=i, max_episode_len=50) for i in range(4)],
                                   policy=_oracle_policy, frames_per_batch=64, total_frames=64,
                                   transition_chunk_size=8)
    try:
        flat = next(iter(collector)).clone()
    finally:
        collector.shutdown()
    with torch.no_grad():
        gae(flat)
        right = gae(env_major(flat, 4))
    right = right[right["collector", "mask"]]
    by_row = torch.empty_like(flat["advantage"])
    order = torch.sort(flat["env_index"], stable=True).indices
    by_row[order] = right["advantage"]
    assert not torch.allclose(flat["advantage"], by_row, atol=1e-4)


@pytest.mark.parametrize("kwargs", [{"replay_buffer": object()}, {"yield_completed_trajectories": True},
                                    {"return_same_td": True}, {"batch_layout": "by_env"}])
def test_env_major_refuses_what_it_cannot_honour(kwargs):
    kwargs = {"batch_layout": "env_major", **kwargs}
    with pytest.raises(ValueError, match="batch_layout"):
        AsyncPoolCollector([OracleEnv] * 2, policy=_oracle_policy, frames_per_batch=8, **kwargs)
