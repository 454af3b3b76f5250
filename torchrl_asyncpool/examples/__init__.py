"""What the training scripts of ``sota-implementations/`` and ``torchrl-asyncpool demo`` share.

Each script keeps its ``Config`` block and its main loop, readable top to bottom; the pieces
they had in common are written once, here:

- :mod:`~torchrl_asyncpool.examples.script_config`: a script's ``Config`` dataclass as
  command-line flags, documented by the comments of its fields;
- :mod:`~torchrl_asyncpool.examples.actor_critic`: the actor-critic of PPO and IMPALA;
- :mod:`~torchrl_asyncpool.examples.batches`: a batch as per-env runs, episode returns,
  advantage normalisation;
- :mod:`~torchrl_asyncpool.examples.impala`: IMPALA's learner step (V-trace targets and the
  loss), shared by ``impala_cartpole.py`` and the ``demo`` command;
- :mod:`~torchrl_asyncpool.examples.plots`: the learning curve;
- :mod:`~torchrl_asyncpool.examples.learner_process`: the start of a script's process, the same
  with either collector;
- :mod:`~torchrl_asyncpool.examples.eval_return`: the evaluation at the end of a script (the
  mean return of seeded episodes).
- :mod:`~torchrl_asyncpool.examples.ray_env_hosts`: the ``--remote-address`` and ``--ray-hosts``
  flags of the MuJoCo and Atari scripts (their envs in env hosts that Ray starts).
"""
