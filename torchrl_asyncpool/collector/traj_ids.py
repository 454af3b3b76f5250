"""TorchRL's ``("collector", "traj_ids")`` for batches made of per-env chunks.

A batch of :class:`~torchrl_asyncpool.AsyncPoolCollector` is a row of chunks, each a run of one
env's consecutive transitions, in the order they completed: an env's rows are in time order, but
other envs' chunks lie between them. TorchRL's collectors mark every transition with the id of
its trajectory (one id per episode of one env, never reused), which is what
:func:`torchrl.collectors.utils.split_trajectories` groups by. :class:`TrajectoryIds` assigns the
same ids here, carrying each env's open trajectory from one batch to the next, with a handful of
tensor operations per batch (no Python loop over envs). TorchRL's ``split_trajectories`` wants
each trajectory's rows next to each other, as its own collectors' ``[num_envs, T]`` batches have
them: :func:`by_trajectory` orders a batch so (one gather, on demand: the collector does not pay
it for learners that do not need it).
"""
from __future__ import annotations

import torch

__all__ = ["TrajectoryIds", "TRAJ_IDS_KEY", "MASK_KEY", "by_trajectory", "env_major"]

#: where TorchRL's collectors put the trajectory ids
TRAJ_IDS_KEY = ("collector", "traj_ids")
#: where TorchRL puts the mask of valid entries of a padded batch (``split_trajectories``)
MASK_KEY = ("collector", "mask")


class TrajectoryIds:
    """Trajectory ids for the batches of a pool of ``num_envs`` envs.

    Args:
        num_envs (int): envs of the pool.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.collector.traj_ids import TrajectoryIds
        >>> ids = TrajectoryIds(2)
        >>> env = torch.tensor([0, 0, 1, 1, 0, 0])
        >>> done = torch.tensor([False, True, False, False, False, False])
        >>> ids(env, done).tolist()  # env 0's episode ends at its 2nd row: its 3rd row starts a new one
        [0, 0, 1, 1, 2, 2]
        >>> ids(torch.tensor([1, 0]), torch.tensor([True, False])).tolist()  # both go on
        [1, 2]
    """

    def __init__(self, num_envs: int):
        self._current = torch.full((num_envs,), -1, dtype=torch.int64)  # each env's open trajectory
        self._ended = torch.ones(num_envs, dtype=torch.bool)  # its last row ended it (or it has none yet)
        self._next_id = 0

    def __call__(self, env_index: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """The ids of a batch's rows; ``env_index`` and ``done`` are ``[N]`` (``done`` of each
        transition, ``("next", "done")``)."""
        n = env_index.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        order = torch.sort(env_index, stable=True).indices  # each env's rows together, in time order
        env, done = env_index[order], done[order].to(torch.bool)
        first = torch.ones(n, dtype=torch.bool)
        first[1:] = env[1:] != env[:-1]
        after_end = torch.empty(n, dtype=torch.bool)
        after_end[1:] = done[:-1]
        after_end[first] = self._ended[env[first]]
        new = after_end  # a row after its env's episode ended starts a new trajectory
        in_batch_order = torch.empty(n, dtype=torch.int64)
        in_batch_order[order] = new.to(torch.int64)  # ids are numbered in the order trajectories appear
        new_ids = (self._next_id + torch.cumsum(in_batch_order, 0) - 1)[order]
        self._next_id += int(new.sum())
        marker = new | first  # every env's first row is a marker: nothing carries over from another env
        value = torch.where(new, new_ids, self._current[env])
        last_marker = torch.where(marker, torch.arange(n), torch.zeros(n, dtype=torch.int64)).cummax(0).values
        ids_sorted = value[last_marker]
        last = torch.ones(n, dtype=torch.bool)
        last[:-1] = env[1:] != env[:-1]
        self._current[env[last]] = ids_sorted[last]
        self._ended[env[last]] = done[last]
        ids = torch.empty(n, dtype=torch.int64)
        ids[order] = ids_sorted
        return ids


def by_trajectory(batch):
    """``batch`` with its rows ordered by ``("collector", "traj_ids")``, each trajectory's rows in
    time order (a new TensorDict: one gather): what TorchRL's
    :func:`~torchrl.collectors.utils.split_trajectories` expects, and a layout in which an
    advantage estimator run along the batch never crosses from one env into another.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.collector.traj_ids import by_trajectory
        >>> batch = TensorDict({("collector", "traj_ids"): torch.tensor([0, 0, 1, 0]), "x": torch.arange(4)}, [4])
        >>> by_trajectory(batch)["x"].tolist()
        [0, 1, 3, 2]
    """
    order = torch.sort(batch.get(TRAJ_IDS_KEY), stable=True).indices
    return batch[order]


def env_major(batch, num_envs: int, env_key: str = "env_index"):
    """``batch`` (``[N]``, a collector batch) as ``[num_envs, T]``: row ``e`` holds env ``e``'s
    transitions in time order, left-padded with zeros up to ``T``, the most any env has in the
    batch; ``("collector", "mask")`` is ``True`` on the ``N`` real entries, and the dims are named
    ``[None, "time"]`` as TorchRL's collectors name theirs.

    This is the layout on which TorchRL's value estimators are exact: they run along the time dim
    and an advantage depends only on the steps after it in its row, so each env's advantages are
    those of its own transitions, and the padding, all before the first real step of a row, never
    reaches a real one (whatever the value network says of a zero observation). The last real step
    of a row bootstraps from its next value unless it terminated, as the last step of a row of
    ``Collector(ParallelEnv)`` does. Take ``batch[batch["collector", "mask"]]`` for the ``N`` real
    transitions (env by env) after the estimator, as after TorchRL's ``split_trajectories``. A
    padded ``("collector", "traj_ids")`` is ``-1``; a padded ``env_key`` is its row's env.

    Each env's rows in a collector batch are consecutive transitions (see :mod:`this module
    <torchrl_asyncpool.collector.traj_ids>`), so a row never has a gap.

    Args:
        batch (TensorDictBase): ``[N]`` transitions with ``env_key``.
        num_envs (int): envs of the collector (rows of the result, some all padding when an env
            has no transition in the batch).
        env_key (NestedKey, optional): the env index key. Defaults to ``"env_index"``.

    Returns:
        a new ``[num_envs, T]`` TensorDict.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool.collector.traj_ids import env_major
        >>> batch = TensorDict({"env_index": torch.tensor([1, 1, 0, 1]), "x": torch.arange(4)}, [4])
        >>> out = env_major(batch, 2)
        >>> out["x"].tolist(), out["collector", "mask"].tolist()
        ([[0, 0, 2], [0, 1, 3]], [[False, False, True], [True, True, True]])
    """
    env = batch.get(env_key).reshape(-1)
    if env.numel() != batch.numel() or batch.batch_dims != 1:
        raise ValueError(f"env_major expects a [N] batch with one {env_key!r} per row, got batch size "
                         f"{tuple(batch.batch_size)} and {env_key!r} of shape {tuple(batch.get(env_key).shape)}.")
    n = env.numel()
    counts = torch.bincount(env, minlength=num_envs)
    if counts.numel() > num_envs:
        raise ValueError(f"env_major: {env_key!r} holds env {int(env.max())}, but num_envs is {num_envs}.")
    T = int(counts.max()) if n else 0
    order = torch.sort(env, stable=True).indices  # each env's rows together, in time order
    env_sorted = env[order]
    rank = torch.arange(n) - (torch.cumsum(counts, 0) - counts)[env_sorted]
    dest = env_sorted * T + (T - counts[env_sorted]) + rank  # left-padded: real steps end each row
    out = batch.apply(lambda x: x.new_zeros((num_envs * T, *x.shape[1:])), batch_size=[num_envs * T])
    if TRAJ_IDS_KEY in batch.keys(True):
        out.get(TRAJ_IDS_KEY).fill_(-1)
    out.set(env_key, torch.arange(num_envs).repeat_interleave(T).view_as(out.get(env_key))
            .to(out.get(env_key).dtype))
    out[dest] = batch[order]
    mask = torch.zeros(num_envs * T, dtype=torch.bool)
    mask[dest] = True
    out.set(MASK_KEY, mask)
    out = out.reshape(num_envs, T)
    out.names = [None, "time"]
    return out
