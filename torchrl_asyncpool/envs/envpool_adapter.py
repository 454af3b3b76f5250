"""EnvPool's gymnasium-API envs (``envpool.make_gymnasium(task, num_envs=k)``) hosted as vector
envs: ``k`` slots of one worker, stepped in lockstep (:class:`EnvPoolVectorAdapter`), or, built
with ``batch_size=b < k`` (EnvPool's asynchronous mode), each env answered and stepped on its own
(:class:`EnvPoolAsyncAdapter`).

An EnvPool env is both a ``gymnasium.vector.VectorEnv`` and a ``gymnasium.Env`` (its
``observation_space``/``action_space`` are one env's, its ``reset``/``step`` batched), so it is
recognized before the single-env adapter could take it. Its synchronous mode
(``batch_size == num_envs``, the default) autoresets in gymnasium's ``NEXT_STEP`` mode, the
pool's episode contract: the step after an env ended ignores that env's action and returns its
reset observation (reward 0, not done), published as a ``FIRST`` record.

EnvPool fixes its seeds when it is built (``seed=s`` seeds env ``j`` with ``s + j``; its
``reset(seed=...)`` only warns). When the pool asks for a first seed (``AsyncEnvPool(seed=...)``)
that the env was not built with, the adapter builds the env once more from the same config with
that seed, so sub-env ``j`` starts from ``seed + j`` as a seeded gymnasium vector env does.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Dict

import numpy as np

from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR, env_where, own_attr, plan_of
from torchrl_asyncpool.envs.gymnasium_adapters import GymnasiumVectorAdapter

__all__ = ["EnvPoolAsyncAdapter", "EnvPoolVectorAdapter", "is_envpool"]

_INT32_MAX = 2**31  # EnvPool's seeds are C++ ints


def is_envpool(env) -> bool:
    """True for an EnvPool gymnasium-API env (``envpool.make_gymnasium``), possibly inside
    gymnasium vector wrappers.

    Args:
        env: what an env factory returned.

    Returns:
        Whether ``env.unwrapped`` is an EnvPool env.

    Examples:
        >>> import envpool
        >>> from torchrl_asyncpool.envs.envpool_adapter import is_envpool
        >>> env = envpool.make_gymnasium("CartPole-v1", num_envs=2)
        >>> is_envpool(env)
        True
        >>> env.close()
    """
    # an env of a module never imported cannot be EnvPool's: no import of envpool here
    module = sys.modules.get("envpool.python.gymnasium_envpool")
    if module is None:
        return False
    return isinstance(getattr(env, "unwrapped", env), module.GymnasiumEnvPoolMixin)


def _built_seeds(pool) -> list:
    """The seeds EnvPool gave its envs: ``env_seed`` when set, else ``seed + j``."""
    config = pool.config
    return list(config["env_seed"]) or [config["seed"] + j for j in range(config["num_envs"])]


def _reseeded(env, seed: int, where: str):
    """``env`` (an EnvPool env, closed here) built again from its config with ``seed=seed``."""
    if not 0 <= seed < _INT32_MAX - env.num_envs:
        raise ValueError(f"{where}: the pool's seed {seed} (+ up to {env.num_envs - 1} for its envs) is out "
                         "of EnvPool's range of seeds (a C++ int); seed the pool with a smaller seed.")
    if env.unwrapped is not env:
        raise ValueError(
            f"{where} is an EnvPool env inside gymnasium wrappers, built with seeds {_built_seeds(env.unwrapped)}; "
            f"the pool asks for {seed} + j for env j. EnvPool fixes its seeds when it is built and the pool "
            "cannot rebuild a wrapped one: build it with envpool.make_gymnasium(..., seed=...) in the factory "
            "(through create_env_kwargs), or seed the pool with seed=None."
        )
    spec = env.spec
    config = dict(env.config, seed=int(seed), env_seed=[])
    new_spec = type(spec)(type(spec).gen_config(**config))
    env.close()
    return type(env)(new_spec)


class EnvPoolVectorAdapter(GymnasiumVectorAdapter):
    """Runs an EnvPool gymnasium-API env of ``k`` envs in ``k`` consecutive slots, in lockstep.

    The slots' fields are those of :class:`~torchrl_asyncpool.envs.gymnasium_adapters.GymnasiumEnvAdapter`
    for EnvPool's (single-env) ``observation_space`` and ``action_space``: a ``Discrete`` action
    is an ``int64`` slot entry, which EnvPool casts to its own action dtype (``int32`` for Atari)
    when stepped. :meth:`reset` and :meth:`step` work on all ``k`` envs at once, in ``env_id``
    order (EnvPool's synchronous mode); an env in the asynchronous mode (``batch_size < num_envs``)
    gets an :class:`EnvPoolAsyncAdapter` from :func:`~torchrl_asyncpool.envs.adapters.make_adapter`.

    Args:
        env: an ``envpool.make_gymnasium(...)`` env (optionally inside gymnasium vector wrappers).
        env_index (int, optional): the pool's index of its first env, for error messages.

    Examples:
        >>> import envpool
        >>> import numpy as np
        >>> from torchrl_asyncpool.envs.envpool_adapter import EnvPoolVectorAdapter
        >>> adapter = EnvPoolVectorAdapter(envpool.make_gymnasium("CartPole-v1", num_envs=4))
        >>> adapter.num_envs, adapter.path
        (4, 'envpool')
        >>> obs = adapter.reset()
        >>> obs["observation"].shape
        (4, 4)
        >>> obs, reward, terminated, truncated = adapter.step({"action": np.zeros(4, np.int64)})
        >>> reward.shape, terminated.dtype
        ((4,), dtype('bool'))
        >>> adapter.close()
    """

    path = "envpool"

    def __init__(self, env, env_index: int | None = None):
        where = f"{env_where(env_index)} (an EnvPool env)"
        pool = env.unwrapped
        try:
            if pool.is_async and not isinstance(self, EnvPoolAsyncAdapter):
                raise TypeError(f"{where} runs in EnvPool's asynchronous mode: host it with EnvPoolAsyncAdapter.")
            if plan_of(env) is not None:
                raise TypeError(f"{where}: fixed episode plans (evaluate()) need single envs, not a vector env.")
            seed = own_attr(env, FIRST_SEED_ATTR)
            if seed is not None and _built_seeds(pool) != [seed + j for j in range(pool.num_envs)]:
                env = _reseeded(env, int(seed), where)
        except BaseException:
            env.close()
            raise
        # what GymnasiumVectorAdapter checks besides (NEXT_STEP mode, not an AsyncVectorEnv) holds
        # for every EnvPool env in synchronous mode
        self.env = env
        self.num_envs = int(env.num_envs)
        self._read_spaces(env.single_observation_space, env.single_action_space, where)
        self._first_seed = None  # seeded when built (above); EnvPool's reset(seed=) only warns

    def reset(self):
        """Resets all ``k`` envs (seeded as they were built); returns the observations, each with a
        leading ``k``."""
        obs, _ = self.env.reset()
        return self._obs(obs)

    def step(self, actions: Dict):
        """Steps all ``k`` envs with ``actions["action"]`` (``[k, ...]``, numpy); returns
        ``(obs, reward, terminated, truncated)``, each with a leading ``k``. EnvPool copies the
        actions into its own buffers (casting them to its action dtype), so the slot rows are
        handed over as they are."""
        obs, reward, terminated, truncated, _ = self.env.step(actions["action"])
        return self._obs(obs), reward, terminated, truncated


class EnvPoolAsyncAdapter(EnvPoolVectorAdapter):
    """Runs an EnvPool env built in its asynchronous mode (``batch_size=b < num_envs=k``) in ``k``
    consecutive slots, each env answered and stepped as soon as its action comes.

    In lockstep (:class:`EnvPoolVectorAdapter`) the worker steps its ``k`` envs when the policy
    has answered all of them, and EnvPool's threads idle meanwhile. Here the adapter is a vector
    env of partial steps (see
    :class:`~torchrl_asyncpool.envs.gymnasium_adapters.GymnasiumVectorAdapter`): :meth:`step_some`
    hands EnvPool the actions of the envs the policy has answered (``send(action, env_id)``) and
    returns the records EnvPool has finished, whichever envs they are; a receiving thread waits
    in EnvPool's ``recv`` (which releases the GIL) whenever at least ``b`` envs are stepping, and
    :meth:`fileno` turns readable when it has records. So EnvPool steps some envs while the
    policy thinks about the others, as its own asynchronous loop does.

    ``k`` must be a multiple of ``b``: the first reset collects every env's observation in
    ``k / b`` receives. Autoreset is EnvPool's (gymnasium's ``NEXT_STEP``): the step after an
    env ended returns its reset observation, published as a ``FIRST`` record.

    Args:
        env: an ``envpool.make_gymnasium(..., batch_size=b)`` env with ``b < num_envs``.
        env_index (int, optional): the pool's index of its first env, for error messages.

    Examples:
        >>> import envpool
        >>> import numpy as np
        >>> from torchrl_asyncpool.envs.adapters import make_adapter
        >>> adapter = make_adapter(envpool.make_gymnasium("CartPole-v1", num_envs=4, batch_size=2))
        >>> type(adapter).__name__, adapter.partial
        ('EnvPoolAsyncAdapter', True)
        >>> obs = adapter.reset()  # every env's first observation
        >>> obs["observation"].shape
        (4, 4)
        >>> actions = {"action": np.zeros(4, np.int64)}
        >>> answered = np.zeros(4, bool)
        >>> while not answered.all():  # the pool waits on adapter.fileno() instead
        ...     answered |= adapter.step_some(actions, ~answered)[4]
        >>> adapter.close()
    """

    path = "envpool-async"

    def __init__(self, env, env_index: int | None = None):
        super().__init__(env, env_index)
        pool = self.env.unwrapped
        self.batch_size = int(pool.config["batch_size"])
        if self.num_envs % self.batch_size:
            self.env.close()
            raise ValueError(
                f"{env_where(env_index)} (an EnvPool env): num_envs={self.num_envs} is not a multiple of "
                f"batch_size={self.batch_size}; the pool collects every env's first observation in whole "
                "receives of batch_size envs."
            )
        self.partial = True
        self._cond = threading.Condition()
        self._held = np.zeros(self.num_envs, bool)  # received and published: waiting for the policy's answer
        self._stepping = 0  # sent to EnvPool, not received yet
        self._results = []  # what the receiving thread got, not yet returned by step_some
        self._error = None
        self._closed = False
        self._thread = None
        self._signal_r, self._signal_w = os.pipe()
        for fd in (self._signal_r, self._signal_w):
            os.set_blocking(fd, False)
        self._signalled = False
        self._out = None  # the k-row buffers step_some returns (reused: nothing allocated per call)

    def reset(self):
        """Resets all ``k`` envs (seeded as they were built) and receives each one's first
        observation; returns them, each with a leading ``k``. Then starts the receiving thread."""
        if self._thread is not None:
            raise RuntimeError("EnvPoolAsyncAdapter: reset() once, before the first step_some(); an ended env is "
                               "reset by EnvPool itself on its next step.")
        obs, _, _, _, info = self._scatter([self.env.reset()], first=True)
        self._held[:] = True
        self._thread = threading.Thread(target=self._receive, name="torchrl_asyncpool-envpool-recv", daemon=True)
        self._thread.start()
        return {key: value.copy() for key, value in obs.items()}

    def step(self, actions: Dict):
        raise RuntimeError("EnvPoolAsyncAdapter steps with step_some() (a vector env of partial steps).")

    def step_some(self, actions: Dict, ready):
        """Sends EnvPool the actions of the envs in ``ready`` whose records it returned last
        (``actions["action"]`` rows, ``[k, ...]``), then returns the records received since the
        last call: ``(obs, reward, terminated, truncated, answered)``, each with a leading ``k``;
        ``answered`` marks the envs whose rows hold a record. Never waits."""
        with self._cond:
            if self._signalled:
                try:
                    os.read(self._signal_r, 4096)
                except BlockingIOError:
                    pass
                self._signalled = False
            if self._error is not None:
                raise RuntimeError(f"EnvPool's recv() failed: {self._error!r}") from self._error
            send = np.flatnonzero(self._held & np.asarray(ready, bool))
            if send.size:
                self.env.send(actions["action"][send], send.astype(np.int32))
                self._held[send] = False
                self._stepping += int(send.size)
                self._cond.notify()
            results, self._results = self._results, []
        return self._scatter(results)

    def fileno(self) -> int:
        """Readable when the receiving thread has records for :meth:`step_some`."""
        return self._signal_r

    def _scatter(self, results, first=False):
        """The received batches ``results`` as ``k``-row arrays (the adapter's own buffers), and
        the mask of the envs they hold; those envs now wait for the policy's answer."""
        if self._out is None:
            obs = self._obs(results[0][0]) if results else None
            if obs is None:  # nothing received yet: the buffers come with the first batch
                return None, None, None, None, np.zeros(self.num_envs, bool)
            k = self.num_envs
            self._out = ({key: np.zeros((k, *v.shape[1:]), v.dtype) for key, v in obs.items()},
                         np.zeros(k, np.float32), np.zeros(k, bool), np.zeros(k, bool))
        obs, reward, terminated, truncated = self._out
        answered = np.zeros(self.num_envs, bool)
        pending = list(results)
        while pending or (first and not answered.all()):
            if not pending:  # the first reset: every env's observation, k / b receives in all
                pending.append(self.env.recv())
            out = pending.pop(0)
            if first and len(out) == 2:  # reset() returns (obs, info)
                o, info = out
                r = te = tr = None
            else:
                o, r, te, tr, info = out
            ids = np.asarray(info["env_id"])
            for key, value in self._obs(o).items():
                obs[key][ids] = value
            reward[ids] = 0.0 if r is None else r
            terminated[ids] = False if te is None else te
            truncated[ids] = False if tr is None else tr
            answered[ids] = True
        self._held |= answered
        return obs, reward, terminated, truncated, answered

    def _receive(self) -> None:
        """The receiving thread: ``recv()`` whenever at least ``batch_size`` envs are stepping (a
        receive of fewer would wait for envs the policy has not answered yet)."""
        env, b = self.env, self.batch_size
        while True:
            with self._cond:
                while not self._closed and self._stepping < b:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                out = env.recv()
            except Exception as exc:  # noqa: BLE001 - raised by the worker's next step_some
                with self._cond:
                    self._error = exc
                    self._ring()
                return
            with self._cond:
                self._stepping -= len(out[4]["env_id"])
                self._results.append(out)
                self._ring()

    def _ring(self) -> None:
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._signal_w, b"x")
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Stops the receiving thread (a receive in progress ends with the steps it waits for)
        and closes the env and the signal pipe. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
        super().close()
        for fd in (self._signal_r, self._signal_w):
            os.close(fd)
