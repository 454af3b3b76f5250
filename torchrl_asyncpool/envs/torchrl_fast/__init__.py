"""The fast path for TorchRL gym envs: a worker steps the gymnasium env inside them directly.

A factory that returns TorchRL's ``GymEnv``/``GymWrapper`` (or a ``TransformedEnv`` of one)
costs a worker ~13x the gymnasium step it wraps when stepped through TorchRL (``_step``
builds TensorDicts and encodes through the specs on every call). The records of such an env
are a pure function of the gymnasium env's outputs and a little per-episode state, so this
package recomputes them with numpy: the obs entries encoded as TorchRL encodes them (its spec's
dtype and shape), the reward as a ``float32 [1]``, the actions decoded as ``GymWrapper``
decodes them (one-hot -> ``argmax``, categorical -> ``int``, ``Box`` -> array), and each
supported transform applied in the order TorchRL applies it.

What is supported (everything else falls back to :class:`TorchRLEnvAdapter`, TorchRL's own
stepping, with the reason in the debug log and in ``adapter.fast_path_reason``):

* ``GymEnv``/``GymWrapper`` (the classes themselves, not subclasses, which may override
  ``_step``) over a ``gymnasium`` env, on the CPU, without info readers,
  a ``reward_space`` or spec checks (``CHECK_SPEC_ENCODE``); ``Box`` observations or a flat
  ``Dict`` of ``Box`` (``Discrete`` observations become one-hot vectors in TorchRL: not
  reproduced); ``Discrete`` (one-hot or categorical) or ``Box`` actions; any ``frame_skip``.
  ``from_pixels`` envs are stepped through the gymnasium wrapper that renders them
  (``AddRenderObservation``, or the env's own ``"pixels"`` entry); TorchRL's legacy
  ``GymPixelObservationWrapper`` (gymnasium without ``render_mode``) falls back.
* Transforms, each only with the arguments whose arithmetic is reproduced exactly:
  ``StepCounter`` (any ``max_steps``), ``RewardSum`` (the env's reward, summed into an
  observation entry), ``RewardScaling`` and ``ObservationNorm`` (``loc``/``scale`` of the
  entry's dtype, so numpy computes in the dtype torch computes in: torch's 0-d tensors do not
  promote, numpy's do), ``DoubleToFloat`` (observation entries and the action),
  ``CatTensors`` (inputs of one dtype) and ``UnsqueezeTransform`` (observation entries).
  Transforms with learned or shared state (``VecNorm``), with an inverse on anything but the
  action, or that need TensorDicts (``TensorDictPrimer`` specs, policies as transforms) fall back.
* ``GymEnv(env_id, num_envs=k)`` (optionally transformed, as above except
  ``StepCounter(max_steps=...)``): ``k`` slots of one worker stepped in lockstep, sub-env ``j``
  with the records of ``GymEnv(env_id)`` seeded ``seed + j``
  (:class:`TorchRLGymVectorFastAdapter`). TorchRL's own stepping cannot host it (see there), so
  a ``num_envs`` env this package refuses is an error, not a fallback. ``GymWrapper`` over a
  vector env that does not autoreset (``DISABLED``, no transforms) is stepped directly too, its
  ended envs reset with a reset mask as TorchRL does; one that autoresets in ``SAME_STEP`` mode
  falls back to TorchRL's batched stepping.

A single env whose record is its gymnasium observation (one ``Box`` of the spec's dtype and
shape), cast by ``DoubleToFloat``, plus at most a ``StepCounter`` count and a ``RewardSum`` sum
(TorchRL's MuJoCo idiom) is stepped by the worker straight into the slot's rows, without
building the record (``_Plan.direct``), and, with the C extension and no frame skipping, in the
worker's C pass loop as a plain gymnasium env is (``c_step``: the count and the sum advanced in
C); so are the sub-envs of ``GymEnv(env_id, num_envs=k)`` hosted one by one. Every other
supported env builds the record and copies its entries.

Which path a slot takes: ``adapter.path`` (:func:`adapter_path`) and a debug log line of the
``torchrl_asyncpool.envs.torchrl_fast`` logger when the adapter is built (in the pool's
process for the env it reads its specs from, and in each worker). An env that must stay on
TorchRL's stepping: set :data:`FAST_PATH_ATTR` to ``False`` on it.

Before an env is put on the fast path its transform pipeline is dry-run on zero observations
and must produce exactly the keys, shapes and dtypes of the TorchRL env's observation spec (the
slot layout). Seeding goes through TorchRL's own ``set_seed`` (once per seed), so the random
streams are TorchRL's. ``test/test_torchrl_envs.py`` runs TorchRL's env and the fast path from
the same seeds with the same actions and compares every record.

The package's modules, bottom up: :mod:`~torchrl_asyncpool.envs.torchrl_fast.unsupported`
(the refusal every check raises), :mod:`~torchrl_asyncpool.envs.torchrl_fast.base_env` (the
checks and observation encoding of the ``GymEnv``/``GymWrapper`` under the transforms),
:mod:`~torchrl_asyncpool.envs.torchrl_fast.transforms` (the transforms reproduced on numpy
records), :mod:`~torchrl_asyncpool.envs.torchrl_fast.plan` (:func:`fast_plan`: what is read
once from an env) and :mod:`~torchrl_asyncpool.envs.torchrl_fast.adapters` (the adapters that
step it).
"""
from __future__ import annotations

from torchrl_asyncpool.envs.torchrl_fast.adapters import (
    TorchRLGymFastAdapter, TorchRLGymVectorFastAdapter, VectorSubEnvAdapter, log_choice,
)
from torchrl_asyncpool.envs.torchrl_fast.plan import FAST_PATH_ATTR, fast_plan
from torchrl_asyncpool.envs.torchrl_fast.unsupported import FastPathUnsupported

__all__ = ["FAST_PATH_ATTR", "FastPathUnsupported", "fast_plan", "TorchRLGymFastAdapter",
           "TorchRLGymVectorFastAdapter", "VectorSubEnvAdapter", "log_choice"]
