"""The collector's policy loop: the consumer of the exchange, in a thread of the driver process.

``wait_ready -> recv (flush deadline) -> policy -> cast to the declared dtypes -> send``. The
loop is pure-functional: any recurrent state travels in the slots.
"""
from __future__ import annotations

import threading
import time
import traceback

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs.utils import set_exploration_type

__all__ = ["PolicyLoop", "derive_policy_outputs"]


def derive_policy_outputs(policy, request: dict, actions: dict, version_key, exploration_type, device=None) -> dict:
    """Runs ``policy`` once on a zero record to learn which entries it adds besides the actions.

    Returns ``{key: (shape, dtype)}`` of the policy outputs to carry in the slots (and thus
    in the transitions), plus ``version_key`` as an int64 scalar when it is not ``None``.
    Raises ``ValueError`` naming the missing key when the policy does not write an action.
    """
    fake = TensorDict({k: torch.zeros((1, *shape), dtype=dtype) for k, (shape, dtype) in request.items()}, [1])
    inputs = set(fake.keys(True, True))
    out = _run(policy, fake, exploration_type, device)
    produced = {k: v for k, v in out.items(include_nested=True, leaves_only=True)}
    for key in actions:
        key_t = key if isinstance(key, str) or len(key) > 1 else key[0]
        if key_t not in produced:
            raise ValueError(
                f"the policy did not write the action key {key_t!r} (it wrote {sorted(map(str, produced))})."
            )
    outputs = {}
    for key, value in produced.items():
        norm = (key,) if isinstance(key, str) else tuple(key)
        if key in inputs or norm in actions or (len(norm) == 1 and norm[0] in actions):
            continue
        if isinstance(value, torch.Tensor) and value.shape[:1] == (1,):
            outputs[key] = (tuple(value.shape[1:]), value.dtype)
    if version_key is not None:
        outputs[version_key] = ((), torch.int64)
    return outputs


def _run(policy, td, exploration_type, device):
    with torch.no_grad(), set_exploration_type(exploration_type):
        if device is not None and device.type != "cpu":
            out = policy(td.to(device, non_blocking=True))
            return out.to("cpu")
        return policy(td)


class PolicyLoop:
    """Serves a pool's slots with one policy from a thread of this process.

    Args:
        pool (AsyncEnvPool): the pool to consume (this loop becomes its only consumer).
        policy (callable): ``TensorDict -> TensorDict``.

    Keyword Args:
        max_get (int, optional): largest batch; ``None`` follows how many envs are in flight.
        min_get (int): smallest batch.
        timeout (float): flush deadline, counted from the first ready record.
        exploration_type: under which the policy acts.
        policy_version_key: key stamped with :attr:`policy_version`, or ``None``.
        policy_version (int): initial version.
        device (torch.device, optional): where the policy runs.
    """

    def __init__(self, pool, policy, *, max_get=None, min_get=1, timeout=0.001, exploration_type=None,
                 policy_version_key="policy_version", policy_version=0, device=None):
        self._consumer = pool._local_consumer()
        self._policy = policy
        self._max_get = max_get
        self._min_get = min_get
        self._timeout = timeout
        self._exploration_type = exploration_type
        self._version_key = policy_version_key
        self.policy_version = int(policy_version)
        self._device = device
        arena = self._consumer.arena
        self._dtypes = {k: arena.response.get(k).dtype for k in self._consumer.response_keys}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pause = threading.Event()
        self._parked = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="AsyncPoolCollector-policy", daemon=True)
        self._reset_stats()

    def _reset_stats(self):
        self._t0 = time.monotonic()
        self._batches = self._frames = 0
        self._infer_s = self._queue_s = 0.0

    def start(self):
        self._thread.start()

    def _run(self):
        c = self._consumer
        try:
            while not self._stop.is_set():
                if self._pause.is_set():
                    self._parked.set()
                    while self._pause.is_set() and not self._stop.is_set():
                        time.sleep(0.005)
                    self._parked.clear()
                    continue
                t_wait = time.monotonic()
                if c.wait_ready(self._min_get, timeout=0.1) < self._min_get:
                    continue
                max_get = self._max_get
                td = c.recv(self._min_get, max_get, timeout=self._timeout)
                t_infer = time.monotonic()
                with self._lock:
                    out = _run(self._policy, td, self._exploration_type, self._device)
                    version = self.policy_version
                b = td.batch_size[0]
                resp = {}
                for key, dtype in self._dtypes.items():
                    if key == self._version_key:
                        resp[key] = torch.full((b,), version, dtype=torch.int64)
                        continue
                    value = out.get(key, None)
                    if value is None:
                        raise ValueError(f"the policy did not write {key!r} for this batch.")
                    resp[key] = value if value.dtype == dtype else value.to(dtype)
                c.send(TensorDict(resp, [b]), td.env_indices)
                t_end = time.monotonic()
                self._batches += 1
                self._frames += b
                self._infer_s += t_end - t_infer
                self._queue_s += t_infer - t_wait
        except BaseException as exc:  # noqa: BLE001 - handed to the driver through check()
            exc.__traceback_text__ = traceback.format_exc()
            self._error = exc

    def check(self):
        """Raises the loop's error (env, worker or policy failure), if any."""
        err = self._error
        if err is not None:
            if isinstance(err, (RuntimeError, ValueError)) and type(err).__module__.startswith("torchrl_asyncpool"):
                raise err
            raise RuntimeError(f"the policy loop failed: {type(err).__name__}: {err}") from err
        if not self._thread.is_alive() and not self._stop.is_set() and self._thread.ident is not None:
            raise RuntimeError("the policy loop exited unexpectedly.")

    def update_weights(self, source=None):
        """Loads new weights into the acting policy between batches and bumps the version."""
        with self._lock:
            policy = self._policy
            if source is not None and source is not policy:
                if isinstance(source, torch.nn.Module):
                    TensorDict.from_module(source).to_module(policy)
                elif isinstance(source, TensorDictBase):
                    source.to_module(policy)
                elif isinstance(source, dict):
                    policy.load_state_dict(source)
                else:
                    raise TypeError(
                        f"update_policy_weights_ expects a module, a TensorDict of parameters or a state dict, "
                        f"got {type(source).__name__}."
                    )
            self.policy_version += 1

    def pause(self, timeout=None):
        self._pause.set()
        if not self._parked.wait(timeout):
            self._pause.clear()
            raise TimeoutError("the policy loop did not pause in time.")

    def resume(self):
        self._pause.clear()

    def stats(self, reset=False) -> dict:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        b = max(self._batches, 1)
        out = {
            "batches": self._batches,
            "batches_per_s": self._batches / elapsed,
            "mean_batch_size": self._frames / b,
            "inference_time_s": self._infer_s / b,
            "queueing_time_s": self._queue_s / b,
            "policy_version": self.policy_version,
        }
        if reset:
            self._reset_stats()
        return out

    def stop(self, timeout=5.0):
        self._stop.set()
        self._pause.clear()
        if self._thread.ident is not None:
            self._thread.join(timeout)
