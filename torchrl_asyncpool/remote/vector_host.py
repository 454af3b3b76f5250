"""Host side of protocol 2: ``k`` envs served to a pool's
:class:`~torchrl_asyncpool.remote.RemoteVectorSlot` over one stream."""
from __future__ import annotations

import logging
import queue
import threading

import numpy as np

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.remote.host import EnvHost, RemoteHostError
from torchrl_asyncpool.step_type import StepType

__all__ = ["VectorEnvHost"]

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _MID, _TERM, _TRUNC = (int(s) for s in StepType)


def _step_types(terminated, truncated):
    terminated, truncated = np.asarray(terminated, bool).reshape(-1), np.asarray(truncated, bool).reshape(-1)
    return np.where(terminated, _TERM, np.where(truncated, _TRUNC, _MID)).astype(np.uint8)


class _GymVector:
    """A gymnasium ``VectorEnv`` (NEXT_STEP autoreset): all envs stepped with one call."""

    def __init__(self, vec):
        import gymnasium as gym

        mode = vec.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if getattr(mode, "value", mode) != gym.vector.AutoresetMode.NEXT_STEP.value:
            raise ValueError(f"a vector env host needs gymnasium's NEXT_STEP autoreset mode, got {mode!r}.")
        self.env = vec
        self.num_envs = int(vec.num_envs)
        self.spec = P.spec_of_spaces(vec.single_observation_space, vec.single_action_space)
        self.keys = list(self.spec["observation"])
        self.action_shape = tuple(self.spec["action"][0])
        self.ended = np.zeros(self.num_envs, bool)

    def _obs(self, obs):
        return {k: np.asarray(obs[k]) for k in self.keys} if isinstance(obs, dict) else {"observation": obs}

    def reset(self):
        obs, _ = self.env.reset()
        self.ended[:] = False
        return self._obs(obs)

    def serve(self, envs, resets, actions):
        k = self.num_envs
        if len(envs) != k or not (np.sort(envs) == np.arange(k)).all():
            raise ValueError(f"a vector env host steps its {k} envs together; the pool commanded {len(envs)}.")
        full = np.empty((k, *actions.shape[1:]), actions.dtype)
        full[envs] = actions
        reset = np.zeros(k, bool)
        reset[envs] = resets
        obs, reward, terminated, truncated, _ = self.env.step(full)
        obs = self._obs(obs)
        sts = _step_types(terminated, truncated)
        rewards = np.array(reward, np.float64).reshape(k)
        sts[self.ended] = _FIRST  # NEXT_STEP: an env that ended is reset by this step
        rewards[self.ended] = 0.0
        extra = reset & ~self.ended  # a reset of an env that did not end (a new host taking over): reset it now
        if extra.any():
            fresh, _ = self.env.reset(options={"reset_mask": extra})
            fresh = self._obs(fresh)
            obs = {key: np.array(v) for key, v in obs.items()}
            for key in obs:
                obs[key][extra] = fresh[key][extra]
            sts[extra], rewards[extra] = _FIRST, 0.0
        self.ended = (sts == _TERM) | (sts == _TRUNC)
        return np.arange(k), sts, rewards, obs

    def close(self):
        self.env.close()


class _TorchRLBatched:
    """A TorchRL env with ``batch_size=[k]``: resets with a ``"_reset"`` mask, steps with a
    ``"_step"`` mask when some envs are being reset."""

    def __init__(self, env):
        import torch

        from torchrl_asyncpool.remote.torchrl_env import _space

        if len(env.batch_size) != 1:
            raise ValueError(f"a TorchRL env host needs batch_size=[k], got {tuple(env.batch_size)}.")
        keys = list(env.observation_spec.keys(True, True))
        if any(not isinstance(key, str) for key in keys) or list(env.action_keys) != ["action"]:
            raise TypeError("a remote TorchRL env needs flat observation keys and the single action key 'action'.")
        import gymnasium as gym

        self.env, self.torch = env, torch
        self.num_envs = int(env.batch_size[0])
        self.keys = keys
        space = gym.spaces.Dict({k: _space(env.observation_spec[k][0], f"observation {k!r}") for k in keys})
        self.spec = P.spec_of_spaces(space, _space(env.full_action_spec["action"][0], "the action"))
        self._action_dtype = env.full_action_spec["action"].dtype
        self._reward_key = env.reward_keys[0]
        self._done_shape = tuple(env.full_done_spec["done"].shape[1:])
        self._td = None

    def _obs(self, td):
        return {k: td.get(k).numpy() for k in self.keys}

    def reset(self):
        self._td = self.env.reset()
        return self._obs(self._td)

    def serve(self, envs, resets, actions):
        from tensordict import TensorDict
        from torchrl.envs.utils import step_mdp

        torch, k = self.torch, self.num_envs
        reset = np.zeros(k, bool)
        reset[envs] = resets
        stepping = np.zeros(k, bool)
        stepping[envs] = ~resets
        obs = {key: np.zeros((k, *self.env.observation_spec[key].shape[1:]),
                             torch.empty((), dtype=self.env.observation_spec[key].dtype).numpy().dtype)
               for key in self.keys}
        sts, rewards = np.zeros(k, np.uint8), np.zeros(k)
        if reset.any():
            m = torch.from_numpy(reset)
            out = self.env.reset(TensorDict({"_reset": m.reshape((k, *self._done_shape))}, [k]))
            have = set(self._td.keys(True, True))
            for key in out.keys(True, True):
                if key != "_reset" and key in have:
                    self._td.get(key)[m] = out.get(key)[m]
            for key in self.keys:
                obs[key][reset] = out.get(key).numpy()[reset]
            sts[reset] = _FIRST
        if stepping.any():
            full = np.zeros((k, *actions.shape[1:]), actions.dtype)
            full[envs] = actions
            td = self._td.set("action", torch.as_tensor(full, dtype=self._action_dtype))
            td.pop("_step", None)
            if not stepping.all():
                td.set("_step", torch.from_numpy(stepping))
            out = self.env.step(td)
            out.pop("_step", None)
            nxt = out.get("next")
            for key in self.keys:
                obs[key][stepping] = nxt.get(key).numpy()[stepping]
            rewards[stepping] = nxt.get(self._reward_key).reshape(k).double().numpy()[stepping]
            done = nxt.get("done").reshape(k).numpy()
            term = nxt.get("terminated").reshape(k).numpy() if "terminated" in nxt.keys() else done
            trunc = nxt.get("truncated").reshape(k).numpy() if "truncated" in nxt.keys() else done & ~term
            sts[stepping] = _step_types(term, trunc)[stepping]
            self._td = step_mdp(out)
        order = np.asarray(envs)
        return order, sts[order], rewards[order], {key: v[order] for key, v in obs.items()}

    def close(self):
        self.env.close()


class _Threaded:
    """``k`` single envs, each built, stepped and reset by a thread of its own (envs that block:
    their steps overlap). Each env answers its command as soon as its step is done: its record
    goes to the host's outbox, which sends whatever records are waiting as one message, so a
    slow env holds back no other (``independent``)."""

    independent = True

    def __init__(self, envs):
        import gymnasium as gym

        self.num_envs = len(envs)
        self._made = [None] * self.num_envs
        self._inbox = [queue.SimpleQueue() for _ in range(self.num_envs)]
        self._built = queue.SimpleQueue()
        self._threads = []
        self.emit = self.fail = None  # set by the host for each stream (see start)
        for j, env in enumerate(envs):
            t = threading.Thread(target=self._run, args=(j, env), name=f"env-host-env-{j}", daemon=True)
            t.start()
            self._threads.append(t)
        built = [self._built.get() for _ in range(self.num_envs)]
        errors = [r for r in built if isinstance(r[1], BaseException)]
        if errors:
            self.close()
            raise errors[0][1]
        first = self._made[0]
        self.dict_obs = isinstance(first.observation_space, gym.spaces.Dict)
        self.spec = P.spec_of_spaces(first.observation_space, first.action_space)
        self.keys = list(self.spec["observation"])

    def _run(self, j, env):
        from torchrl_asyncpool.remote.torchrl_env import as_gymnasium

        try:
            if isinstance(env, type) or (callable(env) and not hasattr(env, "step")):
                env = env()
            env = self._made[j] = as_gymnasium(env)
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._built.put((j, exc))
            return
        self._built.put((j, None))
        inbox = self._inbox[j]
        while True:
            item = inbox.get()
            if item is None:
                break
            emit, fail, cmd = item
            try:
                if cmd is True:
                    obs, _ = env.reset()
                    st, reward = _FIRST, 0.0
                else:
                    obs, reward, terminated, truncated, _ = env.step(cmd)
                    st = _TERM if terminated else (_TRUNC if truncated else _MID)
                emit((j, st, float(reward), obs if self.dict_obs else {"observation": obs}))
            except BaseException as exc:  # noqa: BLE001 - raised in the host's thread (see start)
                fail(exc)
        env.close()

    def start(self, emit, fail):
        """Records of this stream go to ``emit((env, step type, reward, obs))``, an env's error
        to ``fail(exc)``; every env resets (its ``FIRST`` record is the stream's first)."""
        self.emit, self.fail = emit, fail
        for inbox in self._inbox:
            inbox.put((emit, fail, True))

    def command(self, envs, resets, actions):
        """Hands each env its command (a reset, or its action); returns at once. The records
        answering a command for every env (a pool stepping the host's envs in lockstep, which
        waits for all of them anyway) go out together, as one message."""
        emit, fail = self.emit, self.fail
        if len(envs) == self.num_envs > 1:
            emit = _Gather(len(envs), emit).put
        scalar = actions.ndim == 1 and actions.dtype.kind in "iu"
        for j, reset, action in zip(envs.tolist(), resets.tolist(), actions.tolist() if scalar else actions):
            self._inbox[j].put((emit, fail, True if reset else action))

    def close(self, timeout: float = 10.0):
        import time

        for inbox in self._inbox:
            inbox.put(None)
        deadline = time.monotonic() + timeout  # one bound for all: an env may hang in its step
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _Gather:
    """Hands ``n`` records to ``emit`` as one list once all are in."""

    def __init__(self, n, emit):
        self._records, self._n, self._emit = [], n, emit
        self._lock = threading.Lock()

    def put(self, record):
        with self._lock:
            self._records.append(record)
            done = len(self._records) == self._n
        if done:
            self._emit(self._records)


class _RecordOutbox:
    """The request stream of a host whose envs answer one by one: each message carries every
    record waiting when the stream is ready to send (one record when the envs come one at a
    time, a whole batch when they finish together). Counts the steps sent (``host.steps``).

    Over grpcio's public stream, a thread of gRPC iterates it; where the host drives its stream
    itself, the call packs what is posted meanwhile with :meth:`pack` (see ``EnvHost._stream``)."""

    def __init__(self, codec, host):
        self._q = queue.SimpleQueue()
        self.put = self._q.put
        self._codec, self._host = codec, host

    def pack(self, items):
        """One message of the records in ``items`` (records, or lists of the records of a whole
        command: see ``_Threaded.command``)."""
        records = []
        for item in items:
            if isinstance(item, list):
                records += item
            else:
                records.append(item)
        return self._pack(records)

    def _pack(self, records):
        envs = [r[0] for r in records]
        sts = [r[1] for r in records]
        rewards = [r[2] for r in records]
        keys = records[0][3].keys()
        obs = {key: np.stack([np.asarray(r[3][key]) for r in records]) for key in keys}
        self._host.steps += sum(st != _FIRST for st in sts)
        self._host.messages += 1
        return self._codec.pack_records(envs, sts, rewards, obs)

    def __iter__(self):
        get, get_nowait, empty = self._q.get, self._q.get_nowait, queue.Empty
        item = get()
        while item is not None:
            if isinstance(item, bytes):  # the hello
                yield item
                item = get()
                continue
            items = [item]
            while True:
                try:
                    item = get_nowait()
                except empty:
                    item = get
                    break
                if item is None or isinstance(item, bytes):
                    break
                items.append(item)
            yield self.pack(items)
            if item is get:
                item = get()


def _backend(envs):
    import gymnasium as gym
    from torchrl.envs import EnvBase

    if isinstance(envs, (list, tuple)):
        return _Threaded(list(envs))
    if isinstance(envs, gym.vector.VectorEnv):
        return _GymVector(envs)
    if isinstance(envs, EnvBase):
        return _TorchRLBatched(envs)
    raise TypeError(f"a vector env host serves a gymnasium VectorEnv, a TorchRL env with batch_size=[k] or a list "
                    f"of k envs (or factories), got {type(envs).__name__}.")


class VectorEnvHost(EnvHost):
    """Serves ``k`` envs to a pool's :class:`~torchrl_asyncpool.remote.RemoteVectorSlot` over
    one stream (protocol 2 of ``env_host.proto``).

    One hello declares ``k`` and the per-env spec; each message to the pool carries the records
    of the envs that answered a command (env-local index, step type, reward, observation bytes),
    and each message from the pool carries the commands of those envs (an action, or a reset
    after a terminal record).

    Args:
        envs: what steps the ``k`` envs: a :class:`gymnasium.vector.VectorEnv` (NEXT_STEP
            autoreset, its default; stepped with one call), a TorchRL
            :class:`~torchrl.envs.EnvBase` with ``batch_size=[k]`` (reset with a ``"_reset"``
            mask, stepped with a ``"_step"`` mask while some envs reset), a list of ``k`` single
            envs or zero-argument factories (each built and stepped by a thread of its own), or
            a zero-argument factory of any of these, called at the first :meth:`run`.
        address (str): the pool's ``"host:port"``.

    Keyword Args:
        token (str, optional): the pool's token. Defaults to ``None``.
        connect_timeout (float): seconds to wait for the pool. Defaults to ``30``.

    Attributes:
        slot (int): where the host's envs start among the envs of the pool's vector slot
            (its block: ``0`` for a slot of one host), ``None`` before a pool accepted the host.
        steps (int): env steps taken (records other than ``FIRST``), all envs together.
        messages (int): record messages sent (a message carries the records ready together).

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl_asyncpool.remote import VectorEnvHost
        >>> make = lambda: gym.make_vec("CartPole-v1", num_envs=32, vectorization_mode="vector_entry_point")
        >>> host = VectorEnvHost(make, "localhost:50061", connect_timeout=0.5)
        >>> host.run()  # nothing listens there
        Traceback (most recent call last):
          ...
        ConnectionError: no pool accepts connections on localhost:50061 (waited 0.5 s).
    """

    def __init__(self, envs, address: str, *, token: str | None = None, connect_timeout: float = 30.0):
        super().__init__(envs, address, token=token, connect_timeout=connect_timeout)
        self._backend = None
        self.messages = 0

    @property
    def num_envs(self) -> int:
        """The envs served (builds them on first use from a factory)."""
        return self._serving().num_envs

    def _serving(self):
        if self._backend is None:
            envs = self._env
            if callable(envs) and not hasattr(envs, "step") and not isinstance(envs, (list, tuple)):
                envs = envs()
            self._backend = _backend(envs)
        return self._backend

    def close(self) -> None:
        """Closes the served envs."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def run(self, max_steps: int | None = None) -> int:
        """Serves the envs until the pool ends the stream, :meth:`stop`, or ``max_steps`` env
        steps (all envs together; checked between passes); returns the steps taken.

        Raises:
            ConnectionError: nothing accepts connections at ``address`` within ``connect_timeout``.
            RemoteHostError: the pool refused the host (token, spec, number of envs, no free
                slot) or ended its stream with an error.
        """
        self.slot = None  # see EnvHost.run
        backend = self._serving()
        k = backend.num_envs
        codec = P.BatchCodec(backend.spec, k)
        window = P.window_options(codec.max_message_bytes)
        if getattr(backend, "independent", False):
            return self._run_independent(backend, codec, window, max_steps)
        whole = isinstance(backend, _GymVector)  # steps all its envs at once: waits for a command for each

        def serve(responses, send):
            _log.info("env host: %d envs on %s", k, self.address)
            obs = backend.reset()
            send(codec.pack_records(np.arange(k), np.zeros(k, np.uint8), np.zeros(k), obs))
            have = np.zeros(k, bool)
            full_resets = np.zeros(k, bool)
            full_actions = None
            for msg in responses:
                if max_steps is not None and self.steps >= max_steps:
                    break
                envs, resets, actions = codec.unpack_commands(msg)
                if whole and len(envs) < k:  # a pool whose envs answer one by one: gather a full set
                    if full_actions is None:
                        full_actions = np.zeros((k, *actions.shape[1:]), actions.dtype)
                    have[envs], full_resets[envs], full_actions[envs] = True, resets, actions
                    if not have.all():
                        continue
                    envs, resets, actions = np.arange(k), full_resets.copy(), full_actions.copy()
                    have[:] = False
                envs, sts, rewards, obs = backend.serve(envs, resets, actions)
                self.steps += int((sts != _FIRST).sum())
                self.messages += 1
                send(codec.pack_records(envs, sts, rewards, obs))

        return self._stream(P.encode_hello(backend.spec, k), serve, window)

    def _run_independent(self, backend, codec, window, max_steps):
        """:meth:`run` for envs that step one by one (threads): each command goes to its env at
        once and each env's record is sent when it is done (see :class:`_RecordOutbox`)."""
        k = backend.num_envs
        outbox = _RecordOutbox(codec, self)
        failed = []

        def fail(exc):  # an env raised: the stream ends and run() raises it
            failed.append(exc)
            call = self._call
            if call is not None:
                call.cancel()

        def serve(responses, send):
            _log.info("env host: %d envs on %s, stepped one by one", k, self.address)
            backend.start(send, fail)
            try:
                for msg in responses:
                    if failed:
                        break
                    if max_steps is not None and self.steps >= max_steps:
                        break
                    backend.command(*codec.unpack_commands(msg))
            except Exception:
                if not failed:
                    raise
            if failed:
                raise failed[0]

        try:
            return self._stream(P.encode_hello(backend.spec, k), serve, window, outbox=outbox)
        finally:
            backend.emit = backend.fail = None


def serve_from_command_line(args) -> int:
    """``torchrl-asyncpool env-host --protocol 2``: one stream for ``--num-envs`` envs of
    ``--env-id``, stepped by threads (``--vector-mode threads``) or by a gymnasium vector env
    (``sync``, ``vector_entry_point``); returns the command's exit status."""
    import os
    import sys

    import gymnasium as gym

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    token = args.token if args.token is not None else os.environ.get("TORCHRL_ASYNCPOOL_TOKEN")
    if args.num_envs < 1:
        print(f"torchrl-asyncpool env-host: --num-envs must be >= 1, got {args.num_envs}.", file=sys.stderr)
        return 2
    if args.reconnect and args.max_steps is not None:
        print("torchrl-asyncpool env-host: --max-steps does not apply with --reconnect (a host that reconnects "
              "serves until it is stopped); give one of them.", file=sys.stderr)
        return 2
    mode = getattr(args, "vector_mode", "threads")
    try:
        gym.spec(args.env_id)
    except gym.error.Error as exc:
        print(f"torchrl-asyncpool env-host: {exc}", file=sys.stderr)
        return 2
    if mode == "threads":
        envs = [lambda: gym.make(args.env_id) for _ in range(args.num_envs)]
    else:
        envs = gym.make_vec(args.env_id, num_envs=args.num_envs, vectorization_mode=mode)
    host = VectorEnvHost(envs, args.address, token=token, connect_timeout=args.connect_timeout)
    try:
        if args.reconnect:
            host.run_forever()
        else:
            steps = host.run(max_steps=args.max_steps)
            print(f"env host: {steps} steps of {args.env_id} ({args.num_envs} envs over one stream) served to "
                  f"{args.address}", flush=True)
    except (ConnectionError, RemoteHostError) as exc:
        print(f"torchrl-asyncpool env-host: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        host.stop()
        return 130
    finally:
        host.close()
    return 0
