"""What the collector's policy writes, and which recurrent states the env workers carry for it.

An :class:`~torchrl_asyncpool.AsyncPoolCollector` learns both before it builds its pool, and
hands them to the pool as plain values (``policy_output_spec=layout.outputs``,
``recurrent_state=layout.recurrent``):

1. one env is built in this process (the pool's spec env,
   :class:`~torchrl_asyncpool.pool.layout.SpecEnv`, which the collector then hands to the pool's
   start-up plan) to read the fields of its records (observations, reward, flags) and of its
   actions (:meth:`PolicyLayout.from_spec_env`);
2. the acting policy runs once on a zero record
   (:func:`~torchrl_asyncpool.collector.acting_policy.derive_policy_outputs`): what it writes besides the
   actions are its outputs, carried in the slots and delivered in the transitions;
3. TorchRL's recurrent convention (:func:`~torchrl_asyncpool.collector.acting_policy.torchrl_recurrent_state`):
   a policy output ``("next", *key)`` for a ``key`` that one of the env's ``TensorDictPrimer``
   transforms declares is a recurrent state; the worker carries it to the env's next record;
4. any other output ``("next", *key)`` for an entry the env records is left out: in a
   transition that place holds the env's own next entry (TorchRL's env step output wins too).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from torchrl_asyncpool.collector.acting_policy import (
    derive_policy_outputs,
    primer_keys,
    torchrl_recurrent_candidates,
    torchrl_recurrent_state,
)
from torchrl_asyncpool.exchange.arena import as_key
from torchrl_asyncpool.pool.layout import SpecEnv, shadowing_outputs

__all__ = ["PolicyLayout"]


@dataclasses.dataclass(frozen=True)
class PolicyLayout:
    """The policy's side of the slot layout.

    Attributes:
        outputs (dict): ``{key: (shape, dtype)}`` of what the policy writes besides the actions
            (and the policy version key), the pool's ``policy_output_spec``.
        recurrent (dict): ``{slot key: ("next", *key)}``, the pool's ``recurrent_state``: the
            worker fills each record's ``slot key`` with the ``("next", *key)`` the policy wrote
            for the env's previous record (zeros on ``FIRST``).
    """

    outputs: Mapping
    recurrent: Mapping

    @property
    def recurrent_keys(self) -> dict:
        """``{key: slot key}``: where the policy reads each carried state, and the slot entry that
        carries it (:class:`~torchrl_asyncpool.collector.acting_policy.ActingPolicy`'s ``carry``)."""
        return {as_key(nxt)[1:]: as_key(hin) for hin, nxt in self.recurrent.items()}

    @classmethod
    def from_fields(cls, outputs: Mapping, request: Mapping, primers=()) -> PolicyLayout:
        """The layout for a policy writing ``outputs`` on records of fields ``request`` from an
        env whose ``TensorDictPrimer`` keys are ``primers`` (steps 3 and 4 above)."""
        recurrent = torchrl_recurrent_state(outputs, request, primers)
        shadowing = set(shadowing_outputs(outputs, recurrent, request))
        return cls(outputs={k: v for k, v in outputs.items() if k not in shadowing}, recurrent=recurrent)

    @classmethod
    def from_spec_env(cls, policy: Callable, spec_env: SpecEnv, *, version_key="policy_version",
                      device=None) -> PolicyLayout:
        """Runs ``policy`` once on a zero record of ``spec_env``'s fields (the env stays open).

        Args:
            policy (callable): the acting policy (``TensorDict -> TensorDict``).
            spec_env (SpecEnv): the env of the first factory, built in this process.

        Keyword Args:
            version_key (NestedKey, optional): the policy version key stamped on every record
                (``None``: none).
            device (torch.device, optional): where the policy's parameters live.
        """
        request, actions = spec_env.adapter.fields()
        outputs = derive_policy_outputs(policy, dict(request), dict(actions), version_key, device=device)
        primers = primer_keys(spec_env.env) if torchrl_recurrent_candidates(outputs, request) else ()
        return cls.from_fields(outputs, request, primers)

    @classmethod
    def probe(cls, policy: Callable, create_env_fn: Sequence[Callable], create_env_kwargs=None, *,
              version_key="policy_version", device=None) -> PolicyLayout:
        """Builds the first env of ``create_env_fn`` here (and closes it) and runs ``policy`` once
        (:meth:`from_spec_env`).

        Args:
            policy (callable): the acting policy (``TensorDict -> TensorDict``).
            create_env_fn (list of callables): the collector's env factories.
            create_env_kwargs (dict or list of dicts, optional): their keyword arguments.

        Keyword Args:
            version_key (NestedKey, optional): the policy version key stamped on every record
                (``None``: none).
            device (torch.device, optional): where the policy's parameters live.
        """
        with SpecEnv.open(create_env_fn, create_env_kwargs) as spec_env:
            return cls.from_spec_env(policy, spec_env, version_key=version_key, device=device)
