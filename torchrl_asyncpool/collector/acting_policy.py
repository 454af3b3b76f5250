"""The collector's acting policy: the user's policy as the inference server runs it.

The wrapper adds what TorchRL's collectors do around a policy call and what a strict slot
layout needs: the exploration type, a cast of the action entries to the env's action dtypes
(TorchRL envs accept e.g. a float one-hot; the exchange stores exact dtypes), a pause gate
that keeps the policy idle while :meth:`~torchrl_asyncpool.AsyncPoolCollector.pause` is open, and TorchRL's
recurrent-state convention (see :func:`torchrl_recurrent_state`).
"""
from __future__ import annotations

import threading

import torch
from tensordict import TensorDict
from torchrl.envs.utils import set_exploration_type

from torchrl_asyncpool.collector.action_checks import InvalidActionError
from torchrl_asyncpool.collector.direct_call import direct_call
from torchrl_asyncpool.exchange.arena import CARRY_KEY, as_key, key_repr, layout_repr, unread_keys_error
from torchrl_asyncpool.inference.dtype_hint import dtype_mismatch_hint

__all__ = [
    "ActingPolicy", "ActingPolicyFactory", "derive_policy_outputs", "torchrl_recurrent_state",
    "torchrl_recurrent_candidates", "primer_keys",
    "WEIGHT_PREFIX",
]

#: Parameter names of the wrapped policy inside :class:`ActingPolicy`.
WEIGHT_PREFIX = "policy."


class ActingPolicy(torch.nn.Module):
    """Runs ``policy`` under ``exploration_type`` and checks its actions with ``action_checks``.

    Args:
        policy (callable): ``TensorDict -> TensorDict``.
        exploration_type: the exploration type to act under (``None``: leave as is).
        action_checks (dict, optional): ``{key: check}``: each action entry is replaced by
            ``check(entry)``, which casts it to the env's dtype or raises (see
            :mod:`torchrl_asyncpool.collector.action_checks`).
        carry (dict, optional): ``{key: slot key}``: before each call ``key`` is set to the
            record's ``slot key`` entry, the recurrent state the worker carried from the previous
            step (zeros on ``FIRST``); see :func:`torchrl_recurrent_state`.
    """

    def __init__(self, policy, exploration_type=None, action_checks=None, carry=None):
        super().__init__()
        if isinstance(policy, torch.nn.Module):
            self.policy = policy
        else:
            self._callable = policy
        # a plain TensorDictModule is called without its dispatch machinery (direct_call.py)
        self._direct = direct_call(policy)
        self.exploration_type = exploration_type
        # one context object, entered per batch (building one costs about as much as entering it)
        self._explore = set_exploration_type(exploration_type) if exploration_type is not None else None
        self.action_checks = dict(action_checks or {})
        self.carry = dict(carry or {})
        # held by each call, and by pause() until resume(): one uncontended lock per batch
        self._gate = threading.Lock()
        self._pause_state = threading.Lock()  # serializes pause()/resume() (shutdown resumes from any thread)
        self._paused = False

    #: the inference server calls :meth:`forward` directly, skipping ``nn.Module.__call__``'s
    #: hook dispatch (1-3 us a batch): nothing registers hooks on this internal wrapper (the
    #: wrapped policy is still called through ``__call__``, hooks included)
    hookless = True

    def _target(self):
        return self.policy if "policy" in self._modules else self._callable

    @property
    def in_keys(self):
        """The wrapped policy's ``in_keys`` (``AttributeError`` when it declares none): the
        inference server then stages only those entries of each record."""
        in_keys = self._target().in_keys
        if not self.carry:
            return in_keys
        return [self.carry.get(as_key(k), k) for k in in_keys]  # the carried entry stands for the key

    def forward(self, td):
        """Calls the wrapped policy on ``td`` (under the exploration type, after copying the
        carried recurrent state in) and checks the action entries against the env's action spec
        (casting them to its dtypes); returns the policy's output (``td`` when the policy returns
        ``None``)."""
        if self.carry:  # a shallow copy: the staged batch keeps its own entries
            td = td.copy()
            for key, slot_key in self.carry.items():
                td.set(key, td.get(slot_key))
        with self._gate:
            direct = self._direct
            call = direct if direct is not None and direct.applies() else self._target()
            if self._explore is not None:
                with self._explore:
                    out = call(td)
            else:
                out = call(td)
            out = td if out is None else out
            for key, check in self.action_checks.items():
                value = out.get(key, None)
                if value is not None:
                    checked = check(value)
                    if checked is not value:
                        out.set(key, checked)
            return out

    def pause(self, timeout=None) -> None:
        """Blocks new calls and waits until no call is running (at most ``timeout`` seconds,
        then ``TimeoutError`` and nothing is paused); pausing a paused policy does nothing."""
        with self._pause_state:
            if self._paused:
                return
            if not self._gate.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError("the acting policy did not finish its batch in time.")
            self._paused = True

    def resume(self) -> None:
        """Lets calls run again; resuming a running policy does nothing."""
        with self._pause_state:
            if self._paused:
                self._paused = False
                self._gate.release()


class ActingPolicyFactory:
    """A picklable factory of :class:`ActingPolicy` around a user ``policy_factory``."""

    def __init__(self, factory, exploration_type=None, action_checks=None, carry=None):
        self.factory = factory
        self.exploration_type = exploration_type
        self.action_checks = dict(action_checks or {})
        self.carry = dict(carry or {})

    def __call__(self):
        return ActingPolicy(self.factory(), self.exploration_type, self.action_checks, self.carry)


def derive_policy_outputs(policy, request: dict, actions: dict, version_key, device=None) -> dict:
    """Runs ``policy`` once on a zero record to learn which entries it adds besides the actions.

    Returns ``{key: (shape, dtype)}`` of the policy outputs to carry in the slots (and so in
    the transitions), plus ``version_key`` as an int64 scalar when it is not ``None``.
    Raises ``ValueError`` naming the missing key when the policy does not write an action, or
    the keys it declares it reads (``in_keys``) that the record does not hold.
    ``device`` is where the policy's parameters live (the record is built there, as the
    inference server would hand it over).
    """
    fake = TensorDict({k: torch.zeros((1, *shape), dtype=dtype) for k, (shape, dtype) in request.items()}, [1],
                      device=device)
    # what the inference server adds to every batch it hands a policy
    fake.set("env_index", torch.zeros(1, dtype=torch.int64))
    fake.set("valid_mask", torch.ones(1, dtype=torch.bool))
    inputs = set(fake.keys(True, True))
    unread = unread_keys_error(policy, inputs, " (the env's observations and flags, and the env_index and "
                               "valid_mask the inference server adds)")
    if unread is not None:
        raise unread
    try:
        with torch.no_grad():
            out = policy(fake)
    except InvalidActionError:  # names the action key and what is wrong with it
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the record it was given, as the server's dry run does
        leaves = dict(fake.items(include_nested=True, leaves_only=True))
        layout = layout_repr((k, v.shape[1:], v.dtype) for k, v in leaves.items())
        hint = dtype_mismatch_hint({k: v.dtype for k, v in leaves.items()}, policy)
        raise ValueError(
            f"the policy failed on a zero record built from the env's specs {{{layout}}}: "
            f"{type(exc).__name__}: {str(exc).strip().rstrip('.')}.{' ' + hint if hint else ''}"
        ) from exc
    produced = {k: v for k, v in out.items(include_nested=True, leaves_only=True)}
    norm_actions = {as_key(k) for k in actions}
    for key in norm_actions:
        if key_repr(key) not in produced:
            raise ValueError(
                f"the policy did not write the action key {key!r} (it wrote {sorted(map(str, produced))})."
            )
    outputs = {}
    for key, value in produced.items():
        if key in inputs or as_key(key) in norm_actions:
            continue
        if isinstance(value, torch.Tensor) and value.shape[:1] == (1,):
            outputs[key] = (tuple(value.shape[1:]), value.dtype)
    if version_key is not None:
        outputs[version_key] = ((), torch.int64)
    return outputs


def primer_keys(env) -> set:
    """The keys that a TorchRL env's :class:`~torchrl.envs.transforms.TensorDictPrimer` transforms
    declare (nested ``TransformedEnv`` and ``Compose`` included); empty for any other env.

    A primer's keys are observations the env itself does not produce when it steps, which is
    why TorchRL keeps a policy's ``("next", key)`` there (the recurrent state of an
    ``LSTMModule``/``GRUModule`` with ``make_tensordict_primer()``).
    """
    try:
        from torchrl.envs.transforms import Compose, TensorDictPrimer, TransformedEnv
    except ImportError:  # pragma: no cover - torchrl is a dependency
        return set()
    keys = set()
    while isinstance(env, TransformedEnv):
        stack = [env.transform]
        while stack:
            t = stack.pop()
            if isinstance(t, Compose):
                stack.extend(t.transforms)
            elif isinstance(t, TensorDictPrimer):
                keys |= {as_key(k) for k in t.primers.keys(True, True)}
        env = env.base_env
    return keys


def torchrl_recurrent_candidates(outputs: dict, request: dict) -> dict:
    """``{key: ("next", *key)}`` for the policy outputs ``("next", *key)`` that name an env
    observation ``key`` (TorchRL's recurrent-state convention); ``ValueError`` when such an
    output does not have the observation's shape and dtype."""
    observed = {as_key(k): v for k, v in request.items()}
    found = {}
    for out_key, (shape, dtype) in outputs.items():
        k = as_key(out_key)
        if len(k) < 2 or k[0] != "next" or k[1:] not in observed:
            continue
        root = k[1:]
        o_shape, o_dtype = observed[root]
        if (tuple(o_shape), o_dtype) != (tuple(shape), dtype):
            raise ValueError(
                f"the policy writes {k!r} with per-env shape {tuple(shape)} and dtype {dtype}, but the env observes "
                f"{root!r} with shape {tuple(o_shape)} and dtype {o_dtype}: a recurrent state the policy hands to "
                "the next step must have the shape and dtype of its TensorDictPrimer entry."
            )
        found[root] = k
    return found


def torchrl_recurrent_state(outputs: dict, request: dict, primers) -> dict:
    """TorchRL's recurrent-state convention as the pool's ``recurrent_state`` map.

    A TorchRL recurrent policy (``LSTMModule``/``GRUModule`` with the env's
    ``make_tensordict_primer()``) reads its state at ``key`` and writes the next one at
    ``("next", key)``; TorchRL's env step keeps that entry (a primer key is not produced by
    the env) and the next step reads it at ``key``. Here the worker carries it instead: for
    every policy output ``("next", *key)`` where ``key`` is one of ``primers`` (see
    :func:`primer_keys`), returns ``{(CARRY_KEY, *key): ("next", *key)}``, so each record gets
    the state the policy wrote for the previous step of its env (zeros on ``FIRST``).
    :class:`ActingPolicy` (``carry=``) hands it to the policy as ``key``, and the delivered
    transitions hold it at ``key`` and ``("next", key)``
    (:class:`~torchrl_asyncpool.delivery.chunks.ChunkReader`).
    """
    primers = {as_key(k) for k in primers}
    return {
        (CARRY_KEY, *root): nxt
        for root, nxt in torchrl_recurrent_candidates(outputs, request).items()
        if root in primers
    }
