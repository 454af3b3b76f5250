"""The slot layout of an :class:`~torchrl_asyncpool.AsyncEnvPool`: the fields each slot holds,
read from one env built in the calling process (the *spec env*): the record's fields (observations,
reward, flags), the answer's (actions and declared policy outputs), the recurrent-state entries the
workers carry from one record to the next, and the ``env_restarted`` flag of
``on_env_failure="restart"``."""
from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Mapping

import torch

from torchrl_asyncpool.errors import EnvError, SetupRefused
from torchrl_asyncpool.exchange.arena import CARRY_KEY, ArenaLayout, as_key
from torchrl_asyncpool.envs.adapters import make_adapter
from torchrl_asyncpool.workers.record_writer import RESTARTED_KEY
from torchrl_asyncpool.envs.torchrl_vector_hosting import synchronous_vector_envs
from torchrl_asyncpool.pool.arguments import check_factories, check_kwargs


#: where an :class:`~torchrl_asyncpool.errors.EnvError` of the spec env says it raised
SPEC_ENV_WHERE = "this process (env 0 is first built here, to read the specs)"


@contextlib.contextmanager
def spec_env_phase(phase: str):
    """Reports an exception of the spec env's factory or env, raised inside the block, as the
    :class:`~torchrl_asyncpool.errors.EnvError` of env 0 during ``phase`` (chained to it), as a
    worker reports its envs' errors (a :class:`~torchrl_asyncpool.errors.SetupRefused` of this
    package's own factory wrappers is raised as is)."""
    try:
        yield
    except SetupRefused:
        raise
    except Exception as exc:
        raise EnvError(0, phase, traceback.format_exc(), where=SPEC_ENV_WHERE) from exc


def build_spec_env(fns, kwargs):
    """``(env, adapter)``: the env of the first factory, built in this process to read its fields
    and specs (the caller closes the adapter, which closes the env). A factory that raises is
    reported as env 0's :class:`~torchrl_asyncpool.errors.EnvError` during ``"construction"``."""
    # a GymEnv(num_envs=k) built only to read specs steps in this process, not in k new ones
    with synchronous_vector_envs():
        with spec_env_phase("construction"):
            env = fns[0](**kwargs[0])
        return env, make_adapter(env, 0)


class SpecEnv:
    """The env of the first factory, built once in this process to read the fields and specs of
    every slot (and, for ``envs_per_worker="auto"``, timed); the start-up plan
    (:class:`~torchrl_asyncpool.pool.plan.PoolPlan`) reads it, and a collector reads its policy's
    side of the layout from the same env before that, so that it is built once.

    Args:
        fns (list of callables): the checked factories (only the first is called).
        kwargs (list of dicts): their keyword arguments.

    Attributes:
        env: the env as the factory returned it.
        adapter: its env adapter (:func:`~torchrl_asyncpool.envs.adapters.make_adapter`).
        build_s (float): seconds the factory took.
    """

    @classmethod
    def open(cls, create_env_fn, create_env_kwargs=None) -> SpecEnv:
        """Checks ``create_env_fn`` and ``create_env_kwargs`` as the pool does and builds the env
        of the first factory.

        Examples:
            >>> from torchrl_asyncpool.pool.layout import SpecEnv
            >>> from torchrl_asyncpool.testing import ZeroLatencyEnv
            >>> with SpecEnv.open([ZeroLatencyEnv] * 3) as spec:
            ...     sorted(spec.adapter.fields()[1])
            ['action']
        """
        fns = check_factories(create_env_fn)
        return cls(fns, check_kwargs(create_env_kwargs, len(fns)))

    def __init__(self, fns, kwargs):
        #: the factories and their keyword arguments, as checked (a plan built from this env takes them)
        self.create_env_fn, self.create_env_kwargs = list(fns), list(kwargs)
        t0 = time.perf_counter()
        self.env, self.adapter = build_spec_env(fns, kwargs)
        self.build_s = time.perf_counter() - t0
        self.closed = False

    def close(self) -> None:
        """Closes the env (idempotent)."""
        if not self.closed:
            self.closed = True
            self.adapter.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _slot_layout(n, request, response, action_keys, policy_output_spec, recurrent_state, *, restart, transitions):
    """``(layout, policy outputs, recurrent state)`` of ``n`` slots whose env records ``request``
    and is answered ``response`` (the spec env's fields; ``request`` gains the recurrent inputs
    and, with ``restart``, the ``env_restarted`` flag). ``transitions``: the pool delivers
    transitions, where no output may take the place of the env's own next entry."""
    if callable(policy_output_spec):
        policy_output_spec = policy_output_spec(dict(request), dict(response))
    outputs = _check_policy_outputs(policy_output_spec, request, response)
    recurrent = _check_recurrent(recurrent_state, outputs, request)
    if transitions:
        _check_next_outputs(outputs, recurrent, request)
    for hidden_in, hidden_out in recurrent.items():
        request[hidden_in] = outputs[hidden_out]
    if restart is not None:
        if RESTARTED_KEY in request:
            raise ValueError(f"the env observes {RESTARTED_KEY!r}, which on_env_failure='restart' reserves.")
        request[RESTARTED_KEY] = ((1,), torch.bool)  # set on the records an env restart produced
    layout = ArenaLayout(n, request, {**response, **outputs}, action_keys=action_keys, recurrent=recurrent)
    return layout, outputs, recurrent


def _check_policy_outputs(spec, request, response) -> dict:
    if spec is None:
        return {}
    if hasattr(spec, "keys") and hasattr(spec, "shape") and not isinstance(spec, Mapping):
        spec = {k: (tuple(spec[k].shape), spec[k].dtype) for k in spec.keys(True, True)}
    if not isinstance(spec, Mapping):
        raise TypeError(f"policy_output_spec must be a mapping or a Composite spec, got {type(spec).__name__}.")
    out = {}
    for key, value in spec.items():
        if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, tuple):
            value = (tuple(value.shape), value.dtype)
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype)):
            raise ValueError(f"policy_output_spec[{key!r}] must be (shape, dtype) or a spec, got {value!r}.")
        if key in request or key in response:
            raise ValueError(f"policy_output_spec key {key!r} collides with an env observation/action key.")
        out[key] = (tuple(int(s) for s in value[0]), value[1])
    return out


def shadowing_outputs(outputs, recurrent, request) -> list:
    """The policy outputs ``("next", *key)`` for a record entry ``key`` (an observation, the
    reward, a flag): in a transition, ``("next", *key)`` is the env's own next entry, which such
    an output would silently replace. The one exception is TorchRL's recurrent convention as the
    collector maps it (``{(CARRY_KEY, *key): ("next", *key)}`` for a primer key, see
    :func:`~torchrl_asyncpool.collector.acting_policy.torchrl_recurrent_state`): the primer's entry is
    the policy's state, which the transitions deliver in its place. The pool refuses these
    outputs (``_check_next_outputs``); the collector leaves them out (the env's entry wins)."""
    observed = {as_key(k) for k in request}
    carried = {as_key(v) for h, v in recurrent.items() if as_key(h) == (CARRY_KEY, *as_key(v)[1:])}
    return [key for key in outputs
            if len(k := as_key(key)) > 1 and k[0] == "next" and k[1:] in observed and k not in carried]


def _check_next_outputs(outputs, recurrent, request) -> None:
    """Refuses the outputs of :func:`shadowing_outputs`."""
    for key in shadowing_outputs(outputs, recurrent, request):
        k = as_key(key)
        raise ValueError(
            f"policy_output_spec key {key!r} is where the transitions hold the env's own next "
            f"{k[1:] if len(k) > 2 else k[1]!r}; rename the output."
        )


def _check_recurrent(recurrent, outputs, request) -> dict:
    if not recurrent:
        return {}
    if not isinstance(recurrent, Mapping):
        raise TypeError(f"recurrent_state must map hidden_in keys to hidden_out keys, got {type(recurrent).__name__}.")
    for hidden_in, hidden_out in recurrent.items():
        if hidden_out not in outputs:
            raise ValueError(
                f"recurrent_state maps {hidden_in!r} -> {hidden_out!r}, but {hidden_out!r} is not declared in "
                f"policy_output_spec (declared: {list(outputs)})."
            )
        if hidden_in in request or hidden_in in outputs:
            raise ValueError(f"recurrent_state input key {hidden_in!r} collides with an existing key.")
    return dict(recurrent)
