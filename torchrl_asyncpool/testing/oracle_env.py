"""The correctness oracle: an env whose every record says who, which episode and which step it is."""
from __future__ import annotations

import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl_asyncpool.testing._specs import _done_spec
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from torchrl_asyncpool.step_type import StepType

__all__ = ["OracleEnv", "OracleGymEnv", "OracleChecker", "oracle_episode", "oracle_action"]

_NO_ACTION = -1


def oracle_episode(env_id: int, episode_id: int, max_episode_len: int = 7) -> tuple[int, StepType]:
    """Length (number of steps) and ending of episode ``episode_id`` of env ``env_id``.

    Lengths vary between 1 and ``max_episode_len`` and one episode in three is truncated, so
    that envs end episodes at different times and both ending kinds occur.

    Args:
        env_id (int): the env's id (its slot in the oracle's factories).
        episode_id (int): the episode's number in that env, from 0.
        max_episode_len (int): the longest episode. Defaults to 7.

    Returns:
        ``(length, ending)``: the steps of the episode and how its last step ends it
        (``StepType.TERMINATION`` or ``StepType.TRUNCATION``).

    Examples:
        >>> from torchrl_asyncpool.testing import oracle_episode
        >>> oracle_episode(0, 0)
        (1, <StepType.TRUNCATION: 3>)
    """
    length = 1 + (env_id * 31 + episode_id * 17) % max_episode_len
    ending = StepType.TRUNCATION if (env_id + episode_id) % 3 == 0 else StepType.TERMINATION
    return length, ending


def oracle_action(tag: torch.Tensor) -> torch.Tensor:
    """A deterministic policy of the tag: what the oracle's consumer sends back.

    Args:
        tag (torch.Tensor): a single tag ``[3]`` or a batch ``[B, 3]`` of
            ``(env_id, episode_id, step_id)``.

    Returns:
        torch.Tensor: int64 actions of shape ``[]`` / ``[B]``, in ``[0, 1000)``.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.testing import oracle_action
        >>> oracle_action(torch.tensor([2, 1, 3]))
        tensor(37)
    """
    tag = tag.to(torch.int64)
    return (tag[..., 0] * 7 + tag[..., 1] * 13 + tag[..., 2] * 3 + 1) % 1000


class OracleEnv(EnvBase):
    """A TorchRL env whose observation ``"tag"`` encodes ``(env_id, episode_id, step_id)``.

    Every delivered record can be checked for loss, duplication, reordering, wrong autoreset
    pairing and wrong step type (see :class:`OracleChecker`). The observation ``"echo"`` holds
    the action the env received for this step (``-1`` after a reset), which proves that
    actions reach the right env and that the action answering a terminal record is
    discarded. The reward of step ``s`` is ``s``.

    Args:
        env_id (int): identity written into the tag.

    Keyword Args:
        max_episode_len (int): episode lengths vary in ``[1, max_episode_len]``.
        step_delay (float): seconds to sleep per step, scaled by a per-step factor in
            ``{0, 0.5, 1, 1.5}`` so envs drift apart.
        fail_at_step (int, optional): raise ``RuntimeError`` on this global step count.
        fail_on_reset (int, optional): raise ``RuntimeError`` on this reset count (1-based).
        hang_at_step (int, optional): on this global step count, sleep for an hour (a hung
            step, for ``AsyncEnvPool(step_timeout=...)``).
        obs_dim (int): size of an extra float observation ``"observation"``.

    Examples:
        >>> from torchrl_asyncpool.testing import OracleEnv
        >>> env = OracleEnv(env_id=3)
        >>> td = env.reset()
        >>> td["tag"].tolist(), td["echo"].item()
        ([3, 0, 0], -1)
    """

    def __init__(
        self,
        env_id: int = 0,
        *,
        max_episode_len: int = 7,
        step_delay: float = 0.0,
        fail_at_step: int | None = None,
        fail_on_reset: int | None = None,
        hang_at_step: int | None = None,
        obs_dim: int = 2,
    ):
        super().__init__(batch_size=torch.Size([]))
        self.env_id = int(env_id)
        self.max_episode_len = int(max_episode_len)
        self.step_delay = float(step_delay)
        self.fail_at_step = fail_at_step
        self.fail_on_reset = fail_on_reset
        self.hang_at_step = hang_at_step
        self.obs_dim = obs_dim
        self.observation_spec = Composite(
            tag=Unbounded(shape=(3,), dtype=torch.int64),
            echo=Unbounded(shape=(), dtype=torch.int64),
            observation=Unbounded(shape=(obs_dim,), dtype=torch.float32),
        )
        self.action_spec = Categorical(1000, shape=(), dtype=torch.int64)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = _done_spec()
        self.episode = -1
        self.t = 0
        self.total_steps = 0
        self.resets = 0

    def _obs(self, echo: int) -> TensorDict:
        tag = torch.tensor([self.env_id, self.episode, self.t], dtype=torch.int64)
        return TensorDict(
            {
                "tag": tag,
                "echo": torch.tensor(echo, dtype=torch.int64),
                "observation": tag[:1].float().expand(self.obs_dim).clone(),
            },
            batch_size=[],
        )

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDict:
        self.resets += 1
        if self.fail_on_reset is not None and self.resets == self.fail_on_reset:
            raise RuntimeError(f"OracleEnv {self.env_id}: scripted failure on reset {self.resets}")
        self.episode += 1
        self.t = 0
        out = self._obs(_NO_ACTION)
        out.update(_flags(False, False))
        return out

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        self.total_steps += 1
        if self.fail_at_step is not None and self.total_steps == self.fail_at_step:
            raise RuntimeError(f"OracleEnv {self.env_id}: scripted failure at step {self.total_steps}")
        if self.hang_at_step is not None and self.total_steps == self.hang_at_step:
            time.sleep(3600.0)
        if self.episode < 0:
            raise RuntimeError("OracleEnv stepped before reset")
        if self.step_delay:
            time.sleep(self.step_delay * (((self.env_id + 3 * self.t + 5 * self.episode) % 4) / 2.0))
        length, ending = oracle_episode(self.env_id, self.episode, self.max_episode_len)
        if self.t >= length:
            raise RuntimeError(
                f"OracleEnv {self.env_id}: stepped past the end of episode {self.episode} (step {self.t})"
            )
        action = int(tensordict.get("action"))
        self.t += 1
        out = self._obs(action)
        end = self.t == length
        out.update(_flags(end and ending == StepType.TERMINATION, end and ending == StepType.TRUNCATION))
        out.set("reward", torch.tensor([float(self.t)]))
        return out

    def _set_seed(self, seed: int | None):
        return seed


class OracleGymEnv(gym.Env):
    """:class:`OracleEnv` as a plain :class:`gymnasium.Env`, for gymnasium vector envs.

    Same episodes, rewards and ``"tag"`` / ``"echo"`` / ``"observation"`` entries (a
    ``Dict`` observation space), so :class:`OracleChecker` checks pools built from
    ``gymnasium.vector.SyncVectorEnv([... OracleGymEnv(env_id=i) ...])`` with envs ids
    equal to their slot indices.

    Args:
        env_id (int): identity written into the tag.

    Keyword Args:
        max_episode_len (int): episode lengths vary in ``[1, max_episode_len]``.
        fail_at_step (int, optional): raise ``RuntimeError`` on this global step count.
        obs_dim (int): size of the float observation ``"observation"``.

    Examples:
        >>> from torchrl_asyncpool.testing import OracleGymEnv
        >>> obs, _ = OracleGymEnv(env_id=3).reset()
        >>> obs["tag"].tolist(), int(obs["echo"])
        ([3, 0, 0], -1)
    """

    metadata = {"render_modes": []}

    def __init__(self, env_id: int = 0, *, max_episode_len: int = 7, fail_at_step: int | None = None,
                 obs_dim: int = 2):
        self.env_id, self.max_episode_len, self.fail_at_step = int(env_id), int(max_episode_len), fail_at_step
        big = np.iinfo(np.int64).max
        self.observation_space = gym.spaces.Dict({
            "tag": gym.spaces.Box(-1, big, (3,), np.int64),
            "echo": gym.spaces.Box(-1, big, (), np.int64),
            "observation": gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32),
        })
        self.action_space = gym.spaces.Discrete(1000)
        self.obs_dim = obs_dim
        self.episode, self.t, self.total_steps = -1, 0, 0

    def _obs(self, echo):
        tag = np.array([self.env_id, self.episode, self.t], np.int64)
        return {"tag": tag, "echo": np.array(echo, np.int64),
                "observation": np.full(self.obs_dim, self.env_id, np.float32)}

    def reset(self, *, seed=None, options=None):
        """Starts the next episode: ``(observation, {})`` with tag ``(env_id, episode, 0)``."""
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(_NO_ACTION), {}

    def step(self, action):
        """One step: ``(observation, reward, terminated, truncated, {})``, echoing ``action``."""
        self.total_steps += 1
        if self.fail_at_step is not None and self.total_steps == self.fail_at_step:
            raise RuntimeError(f"OracleGymEnv {self.env_id}: scripted failure at step {self.total_steps}")
        length, ending = oracle_episode(self.env_id, self.episode, self.max_episode_len)
        if self.t >= length:
            raise RuntimeError(
                f"OracleGymEnv {self.env_id}: stepped past the end of episode {self.episode} (step {self.t})"
            )
        self.t += 1
        end = self.t == length
        return (self._obs(int(action)), float(self.t), end and ending == StepType.TERMINATION,
                end and ending == StepType.TRUNCATION, {})


def _flags(terminated: bool, truncated: bool) -> dict:
    return {
        "done": torch.tensor([terminated or truncated]),
        "terminated": torch.tensor([terminated]),
        "truncated": torch.tensor([truncated]),
    }


class OracleChecker:
    """Checks a stream of :class:`OracleEnv` records, env by env, in delivery order.

    Call :meth:`observe` (or :meth:`observe_batch`) for every record a consumer receives, or
    :meth:`observe_transitions` for TorchRL-layout transitions. The consumer must answer each
    record with ``policy(tag)`` (:func:`oracle_action` by default): the env echoes the action it
    received in its next record, which is checked against that. Any loss, duplicate, reordering,
    wrong step type or flag, wrong autoreset pairing or misrouted action raises
    :class:`AssertionError` naming the env and what was expected.

    Envs rebuilt by ``on_env_failure="restart"`` are followed too: a record marked
    ``env_restarted`` is either the truncation that cuts an episode (it repeats the last record's
    tag with reward 0) or the first record of a rebuilt env after a failed reset; a rebuilt env
    starts again at episode 0. :attr:`restarts` counts them.

    Args:
        max_episode_len (int): as passed to the envs.
        policy (callable, optional): the tag -> action map the consumer uses.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool import StepType
        >>> from torchrl_asyncpool.testing import OracleChecker
        >>> checker = OracleChecker()
        >>> checker.observe(0, torch.tensor([0, 0, 0]), StepType.FIRST, reward=0.0, echo=-1)
        >>> checker.records
        1
    """

    def __init__(self, max_episode_len: int = 7, policy: Callable = oracle_action):
        self.max_episode_len = max_episode_len
        self.policy = policy
        self._last: dict[int, tuple[int, int, int]] = {}
        self._expect_echo: dict[int, int] = {}
        self._last_transition: dict[int, tuple[int, int, int]] = {}
        self._reborn: set[int] = set()  # envs whose next record is a rebuilt env's first
        self.records = 0
        self.episodes_done = 0
        self.restarts = 0

    def observe(
        self, env_index: int, tag, step_type, reward=None, echo=None, done=None, terminated=None, truncated=None,
        restarted=None,
    ) -> None:
        """Checks one record of env ``env_index`` against the previous one of the same env.

        Args:
            env_index (int): the env the record came from.
            tag (tensor or sequence of 3 ints): the record's ``"tag"`` ``(env_id, episode, t)``.
            step_type (StepType or int): the record's step type.
            reward (float or tensor, optional): checked when given (``None`` skips it).
            echo (int or tensor, optional): the action the env received; checked when given.
            done (bool or tensor, optional): checked when given.
            terminated (bool or tensor, optional): checked when given.
            truncated (bool or tensor, optional): checked when given.
            restarted (bool or tensor, optional): the record's ``env_restarted`` flag.

        Raises:
            AssertionError: naming the env and what was expected.
        """
        tag = tuple(int(x) for x in (tag.tolist() if isinstance(tag, torch.Tensor) else tag))
        st = StepType(int(step_type))
        env_id, ep, t = tag
        where = f"env {env_index}: record {tag} ({st.name})"
        assert env_id == env_index, f"{where}: tag belongs to env {env_id}"
        last = self._last.get(env_index)
        restarted = restarted is not None and bool(torch.as_tensor(restarted).any())
        if restarted and st == StepType.TRUNCATION:  # an episode cut by a restart, at its last record
            assert last is not None and tag == last, f"{where}: a restart's truncation must repeat {last}"
            if reward is not None:
                assert float(torch.as_tensor(reward).reshape(-1)[0]) == 0.0, f"{where}: reward {reward}, expected 0"
            for name, value, want in (("done", done, True), ("terminated", terminated, False),
                                      ("truncated", truncated, True)):
                if value is not None:
                    assert bool(torch.as_tensor(value).any()) == want, f"{where}: {name} is not {want}"
            self._reborn.add(env_index)
            self.records += 1
            self.restarts += 1
            return
        if restarted:  # the first record of an env rebuilt after its reset failed
            assert st == StepType.FIRST, f"{where}: a restart marks only a truncation or a FIRST record"
            if last is not None and env_index not in self._reborn:
                length, _ = oracle_episode(env_id, last[1], self.max_episode_len)
                assert last[2] == length, f"{where}: the env was rebuilt while its episode {last} was open"
            self._reborn.add(env_index)
            self.restarts += 1
        if env_index in self._reborn:
            self._reborn.discard(env_index)
            exp = (env_id, 0, 0)  # a rebuilt env starts from its first episode
        elif last is None:
            exp = (env_id, 0, 0)
        else:
            length, _ = oracle_episode(env_id, last[1], self.max_episode_len)
            exp = (env_id, last[1] + 1, 0) if last[2] == length else (env_id, last[1], last[2] + 1)
        assert tag == exp, f"{where}: expected tag {exp} after {last} (lost, duplicated or reordered record)"
        length, ending = oracle_episode(env_id, ep, self.max_episode_len)
        exp_st = StepType.FIRST if t == 0 else (ending if t == length else StepType.MID)
        assert st == exp_st, f"{where}: step type {st.name}, expected {exp_st.name}"
        if reward is not None:
            assert float(torch.as_tensor(reward).reshape(-1)[0]) == float(t), f"{where}: reward {reward}, expected {t}"
        if echo is not None:
            exp_echo = -1 if t == 0 else self._expect_echo.get(env_index)
            assert int(echo) == exp_echo, (
                f"{where}: env received action {int(echo)}, expected {exp_echo} "
                "(misrouted action, or the action answering a terminal record was not discarded)"
            )
        for name, value, want in (
            ("done", done, st.is_last()),
            ("terminated", terminated, st == StepType.TERMINATION),
            ("truncated", truncated, st == StepType.TRUNCATION),
        ):
            if value is not None:
                got = bool(torch.as_tensor(value).any())
                assert got == want, f"{where}: {name}={got}, expected {want}"
        self._last[env_index] = tag
        self._expect_echo[env_index] = int(self.policy(torch.tensor(tag)))
        self.records += 1
        self.episodes_done += st.is_last()

    def observe_batch(self, td: TensorDictBase, env_indices=None) -> None:
        """Checks every record of a received batch (``recv`` output)."""
        idx = td.get("env_index") if env_indices is None else env_indices
        for i, env_index in enumerate(idx.tolist()):
            self.observe(
                env_index,
                td.get("tag")[i],
                td.get("step_type")[i],
                reward=td.get("reward")[i],
                echo=td.get("echo")[i],
                done=td.get("done")[i],
                terminated=td.get("terminated")[i],
                truncated=td.get("truncated")[i],
                restarted=td.get("env_restarted")[i] if "env_restarted" in td.keys() else None,
            )

    def observe_transitions(self, td: TensorDictBase) -> None:
        """Checks a batch of transitions (TorchRL layout, e.g. ``take_transitions`` or a
        collector batch): per env, in order, each transition must continue the previous one,
        ``("next", "tag")`` must follow ``"tag"``, the action must be the policy's answer to
        ``"tag"`` and reach the env (``("next", "echo")``), flags must match the oracle."""
        env_index = td.get("env_index").reshape(-1).tolist()
        tags = td.get("tag").tolist()
        next_tags = td.get(("next", "tag")).tolist()
        actions = td.get("action").reshape(-1).tolist()
        echoes = td.get(("next", "echo")).reshape(-1).tolist()
        rewards = td.get(("next", "reward")).reshape(-1).tolist()
        flags = {
            k: td.get(("next", k)).reshape(len(env_index), -1).any(-1).tolist()
            for k in ("done", "terminated", "truncated")
        }
        n = len(env_index)
        has_flag = "env_restarted" in td.keys()
        cut = td.get(("next", "env_restarted")).reshape(n, -1).any(-1).tolist() if has_flag else [False] * n
        reborn = td.get("env_restarted").reshape(n, -1).any(-1).tolist() if has_flag else [False] * n
        last = self._last_transition
        for i, e in enumerate(env_index):
            tag, nxt = tuple(tags[i]), tuple(next_tags[i])
            where = f"env {e}: transition {tag} -> {nxt}"
            assert tag[0] == e and nxt[0] == e, f"{where}: tags belong to another env"
            prev = last.get(e)
            if reborn[i] or prev == "restart":  # a rebuilt env's first transition
                assert tag == (e, 0, 0), f"{where}: a rebuilt env must start at episode 0"
                if reborn[i] and prev not in (None, "restart"):
                    length, _ = oracle_episode(e, prev[1], self.max_episode_len)
                    assert prev[2] == length, f"{where}: the env was rebuilt while its episode {prev} was open"
                    self.restarts += 1
            elif prev is None:
                assert tag[2] == 0, f"{where}: the first transition of an env must start an episode"
                assert prev is not None or tag[1] <= 1, f"{where}: episodes were skipped"
            else:
                length, _ = oracle_episode(e, prev[1], self.max_episode_len)
                exp = (e, prev[1] + 1, 0) if prev[2] == length else prev
                assert tag == exp, f"{where}: expected to start at {exp} (lost, duplicated or reordered transition)"
            if cut[i]:  # the env failed on this step: the episode ends at its last observation
                assert nxt == tag, f"{where}: a restart's truncation must repeat the tag"
                assert (flags["done"][i], flags["terminated"][i], flags["truncated"][i]) == (True, False, True), (
                    f"{where}: a restart's truncation must be done and truncated, not terminated")
                assert rewards[i] == 0.0, f"{where}: a restart's truncation has reward {rewards[i]}, expected 0"
                exp_action = int(self.policy(torch.tensor(tag)))
                assert actions[i] == exp_action, f"{where}: action {actions[i]}, expected {exp_action}"
                last[e] = "restart"
                self.records += 1
                self.restarts += 1
                continue
            assert nxt == (e, tag[1], tag[2] + 1), f"{where}: next tag does not follow the tag"
            length, ending = oracle_episode(e, tag[1], self.max_episode_len)
            end = nxt[2] == length
            want = {"done": end, "terminated": end and ending == StepType.TERMINATION,
                    "truncated": end and ending == StepType.TRUNCATION}
            for k, v in want.items():
                assert flags[k][i] == v, f"{where}: ('next', {k!r}) is {flags[k][i]}, expected {v}"
            exp_action = int(self.policy(torch.tensor(tag)))
            assert actions[i] == exp_action, f"{where}: action {actions[i]}, expected {exp_action}"
            assert echoes[i] == actions[i], f"{where}: env received {echoes[i]}, transition says {actions[i]}"
            assert rewards[i] == float(nxt[2]), f"{where}: reward {rewards[i]}, expected {nxt[2]}"
            last[e] = nxt
            self.records += 1
            self.episodes_done += end

    def last_step(self, env_index: int):
        """The last tag seen for ``env_index`` (``None`` before any)."""
        return self._last.get(env_index)

