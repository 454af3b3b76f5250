"""With track_traj_ids=True, batches carry TorchRL's ("collector", "traj_ids"): one id per episode of
one env, carried from one batch to the next; ordered by them (by_trajectory), TorchRL's
split_trajectories and an advantage estimator after it see each env's transitions in order and
never mix two envs."""
import torch
from torchrl.collectors.utils import split_trajectories
from torchrl.objectives.value.functional import generalized_advantage_estimate

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.collector.traj_ids import TrajectoryIds, by_trajectory
from torchrl_asyncpool.testing import OracleEnv, oracle_action


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
                                   track_traj_ids=True)
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
                                   track_traj_ids=True)
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


def test_trajectory_ids_are_off_by_default_as_in_torchrl_async_batched_collector():
    collector = AsyncPoolCollector([OracleEnv] * 2, policy=_oracle_policy, frames_per_batch=8, total_frames=8)
    try:
        assert ("collector", "traj_ids") not in next(iter(collector)).keys(True)
    finally:
        collector.shutdown()
