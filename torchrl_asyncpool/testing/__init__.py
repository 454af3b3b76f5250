"""Envs and checkers for testing and benchmarking pools: the correctness oracle and benchmark workloads."""
from torchrl_asyncpool.testing.bench_envs import SleepPixelEnv, ZeroLatencyEnv
from torchrl_asyncpool.testing.oracle_env import OracleChecker, OracleEnv, OracleGymEnv, oracle_action, oracle_episode

__all__ = [
    "OracleEnv", "OracleGymEnv", "OracleChecker", "oracle_action", "oracle_episode", "ZeroLatencyEnv", "SleepPixelEnv",
]
