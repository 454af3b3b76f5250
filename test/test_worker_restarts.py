"""Worker processes that die (SIGKILL, as the OOM killer sends) or hang (past ``step_timeout``)
under ``on_env_failure="restart"``: the pool replaces them and the oracle env proves that nothing
delivered is lost or duplicated, every cut episode ends in one marked TRUNCATION, and the next
record of that env is FIRST. With ``"raise"``, a hung step ends in an error naming the env."""
import functools
import os
import random
import signal
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError, WorkerDiedError
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena, ArenaLayout
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action
from torchrl_asyncpool.workers.watch import Watcher, WorkerWatch

UNLIMITED = dict(on_env_failure="restart", max_restarts_per_env=10_000, max_restarts=None)


def oracles(n, **kwargs):
    return [functools.partial(OracleEnv, env_id=i, **kwargs) for i in range(n)]


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _answer(pool, td):
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)


def _killer(pool, rng, pick=None):
    """A fault that SIGKILLs a random worker of ``pool`` (or ``pick(pids)``); its ``pids`` are the
    distinct processes it killed (a dead worker not yet replaced, a zombie, takes the signal
    again without a second death)."""
    def kill(k):
        pids = pool.worker_pids
        pid = rng.choice(pids) if pick is None else pick(pids)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # dead and reaped already, its replacement on the way
            return
        kill.pids.add(pid)

    kill.pids = set()
    return kill


def _await_restarts(pool, n, timeout=60.0):
    """Waits until ``pool`` has replaced ``n`` workers (its watchdog runs in check_workers); a
    kill just before the last recv may not have been noticed yet."""
    deadline = time.monotonic() + timeout
    while pool.worker_restarts < n:
        assert time.monotonic() < deadline, f"{pool.worker_restarts} of {n} workers replaced in {timeout}s"
        pool.check_workers()
        time.sleep(0.02)
    return pool.worker_restarts


def _collect_checked(collector, checker, every=None, fault=None):
    """Iterates ``collector`` to its end through ``checker`` (each restart's truncation checked:
    reward 0), calling ``fault(batch number)`` every ``every`` batches; returns the frames."""
    frames = 0
    for k, batch in enumerate(collector):
        checker.observe_transitions(batch)
        frames += batch.numel()
        cut = batch["next", "env_restarted"].reshape(-1)
        assert batch["next", "truncated"].reshape(-1)[cut].all()
        assert (batch["next", "reward"].reshape(-1)[cut] == 0).all()
        if fault is not None and k % every == every // 2:
            fault(k)
    return frames


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (3, False), (3, True)])
def test_killed_workers_are_replaced_and_records_stay_exact(envs_per_worker, env_threads, dev_shm_guard):
    checker = OracleChecker()
    rng = random.Random(envs_per_worker)
    kills = 0
    with AsyncEnvPool(oracles(6), envs_per_worker=envs_per_worker, env_threads=env_threads, **UNLIMITED) as pool:
        for step in range(600):
            td = pool.recv(min_get=1, timeout=30)
            checker.observe_batch(td)
            _answer(pool, td)
            if step % 60 == 30:  # at a random moment of the workers' work: right after an answer
                os.kill(rng.choice(pool.worker_pids), signal.SIGKILL)
                kills += 1
        assert _await_restarts(pool, kills) == kills == 10
        info = pool.restart_info()
    assert checker.records >= 600 and checker.restarts >= kills
    assert all(cause.startswith("worker\n") and "killed by signal 9" in cause for _, cause in info.values())


def test_the_replacement_cuts_the_open_episode_at_the_last_leased_record():
    with AsyncEnvPool([functools.partial(OracleEnv, env_id=1)], **UNLIMITED) as pool:
        td = pool.recv()
        _answer(pool, td)
        td = pool.recv()  # a MID record (OracleEnv 1's first episode is longer than one step)
        assert td["step_type"].tolist() == [1]
        last = td["tag"].clone()
        pid = pool.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        _answer(pool, td)  # answered after the death: the replacement gets it
        cut = pool.recv(timeout=30)
        assert cut["step_type"].tolist() == [3] and cut["env_restarted"].tolist() == [[True]]
        assert torch.equal(cut["tag"], last) and cut["reward"].tolist() == [[0.0]]
        _answer(pool, cut)
        first = pool.recv(timeout=30)
        assert first["step_type"].tolist() == [0] and first["env_restarted"].tolist() == [[False]]
        assert first["tag"].tolist() == [[1, 0, 0]]  # the rebuilt env's first episode
        assert pool.worker_pids[0] != pid and pool.metrics()["worker_restarts"] == 1


def test_a_hung_step_past_step_timeout_is_killed_and_replaced(dev_shm_guard):
    checker = OracleChecker()
    with AsyncEnvPool(oracles(4, hang_at_step=40), envs_per_worker=2, step_timeout=0.5, **UNLIMITED) as pool:
        t0 = time.monotonic()
        while pool.metrics()["worker_restarts"] < 2:
            td = pool.recv(min_get=1, timeout=30)
            checker.observe_batch(td)
            _answer(pool, td)
            assert time.monotonic() - t0 < 60, "the hung steps were not replaced"
        for _ in range(100):  # and collection goes on
            td = pool.recv(min_get=1, timeout=30)
            checker.observe_batch(td)
            _answer(pool, td)
        info = pool.restart_info()
    assert checker.restarts >= 2
    assert any("step_timeout=0.5s in a step" in cause for _, cause in info.values())


def test_a_hung_step_with_raise_is_an_env_error_naming_the_env():
    with AsyncEnvPool(oracles(2, hang_at_step=5), step_timeout=0.5) as pool:
        t0 = time.monotonic()
        with pytest.raises(EnvError, match=r"env \d took more than step_timeout=0.5s in a step") as info:
            for _ in range(100):
                td = pool.recv(min_get=1, timeout=30)
                _answer(pool, td)
        assert time.monotonic() - t0 < 30  # the promise is 0.5 s plus the 20 ms check
        assert info.value.env_index in (0, 1) and info.value.phase == "step"
        with pytest.raises(EnvError):  # sticky, as an env's own error is
            pool.recv(timeout=1)


def test_past_the_budget_a_dead_worker_is_raised_with_the_history():
    with AsyncEnvPool(oracles(2), envs_per_worker=2, on_env_failure="restart", max_restarts_per_env=1,
                      restart_window_s=600) as pool:
        pids = []
        for kill in range(2):
            pids.append(pool.worker_pids[0])
            os.kill(pids[-1], signal.SIGKILL)
            try:
                for _ in range(200):
                    td = pool.recv(min_get=1, timeout=30)
                    _answer(pool, td)
                    if pool.worker_restarts > kill:
                        break
            except WorkerDiedError as exc:
                assert kill == 1
                assert "restart budget exhausted" in str(exc) and "max_restarts_per_env=1" in str(exc)
                assert exc.env_indices == (0, 1)
                # the history lists the death before the last one, and the last one once
                text = str(exc)
                assert text.count(f"pid {pids[1]},") == 1 and text.count(f"pid {pids[0]},") == 1, text
                assert "earlier failures: " in text.split(f"pid {pids[1]},")[1], text
                return
        pytest.fail("the second death was not raised")


@pytest.mark.parametrize("kind", ["gym", "torchrl"])
def test_a_killed_vector_env_worker_is_replaced_and_records_stay_exact(kind, dev_shm_guard):
    from test_env_restarts import _vectors

    checker = OracleChecker()
    with AsyncEnvPool(_vectors(kind, 2, 3), **UNLIMITED) as pool:
        killed = []  # six kills, the two workers in turn, each of a worker that was replaced since
        step = 0
        while step < 300 or len(killed) < 6:
            assert step < 20_000, f"the workers were not replaced in time: killed {killed}"
            td = pool.recv(min_get=1)
            checker.observe_batch(td)
            _answer(pool, td)
            pid = pool.worker_pids[len(killed) % 2]
            if len(killed) < 6 and step >= 20 + 50 * len(killed) and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            step += 1
        assert _await_restarts(pool, 6) == 6
    assert checker.records >= 300 and checker.restarts >= 6


def test_collector_delivers_total_frames_exactly_once_through_kills_hangs_and_env_failures(dev_shm_guard):
    checker = OracleChecker()
    rng = random.Random(0)
    factories = [functools.partial(OracleEnv, env_id=i, hang_at_step=700 if i == 3 else None,
                                   fail_at_step=500 if i == 1 else None) for i in range(6)]
    c = AsyncPoolCollector(factories, policy=oracle_policy, frames_per_batch=240, total_frames=12_000,
                           envs_per_worker=2, step_timeout=0.5, **UNLIMITED)
    kill = _killer(c._pool, rng)
    try:
        frames = _collect_checked(c, checker, every=8, fault=kill)
        assert frames == checker.records == 12_000
        # every worker killed was replaced (the hung steps' workers too); each replacement marks
        # its 2 envs' records, but the last one's may come after the last batch
        assert _await_restarts(c._pool, len(kill.pids)) >= len(kill.pids) >= 2
        assert checker.restarts >= 2 * (len(kill.pids) - 1)
    finally:
        c.shutdown()


def test_a_thread_server_on_its_own_replaces_dead_workers_while_it_serves(dev_shm_guard):
    """No collector calling check_workers: the serving thread runs the pool's watchdog."""
    import threading

    from test_inference import _serve_until

    from torchrl_asyncpool import InferenceServer
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    rows, lock = [], threading.Lock()

    def on_batch(name, request, response):
        with lock:
            rows.extend(zip(request["env_index"].tolist(), request["tag"].clone(), request["step_type"].tolist(),
                            request["echo"].tolist(), request["env_restarted"].reshape(-1).tolist()))

    with AsyncEnvPool(oracles(4), envs_per_worker=2, **UNLIMITED) as pool:
        with InferenceServer(OracleTagPolicy(), on_batch=on_batch).start(pool) as server:
            _serve_until(server, 200)
            os.kill(pool.worker_pids[0], signal.SIGKILL)
            os.kill(pool.worker_pids[1], signal.SIGKILL)  # every worker: nothing is ready until both are back
            _serve_until(server, server.stats()["frames"] + 200)
            assert pool.worker_restarts == 2
    checker = OracleChecker()
    for i, tag, st, echo, restarted in rows:  # every record the server answered, in order per env
        checker.observe(i, tag, st, echo=echo, restarted=restarted)
    assert checker.records >= 400 and checker.restarts >= 4


def test_step_timeout_arguments_are_checked():
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="step_timeout must be None or a positive number"):
            AsyncEnvPool(oracles(1), step_timeout=bad)
    with pytest.raises(ValueError, match="step_timeout needs worker processes"):
        AsyncEnvPool(oracles(1), step_timeout=1.0, backend="threading")


class TestTakeover:
    """What a replacement reads from the slot words of the worker it replaces (workers/watch.py)."""

    @pytest.fixture
    def arenas(self):
        layout = ArenaLayout(1, {"obs": ((2,), torch.int64), "step_type": ((), torch.int8)},
                             {"action": ((), torch.int64)})
        arena, shadow = Arena.create(layout), Arena.create(layout)
        watcher = Watcher(WorkerWatch(_Fd(shadow.fd)), arena)
        yield arena, watcher
        arena.close()
        shadow.close()

    @staticmethod
    def _leased_and_answered(arena, obs):
        arena.request["obs"][0] = torch.tensor(obs)
        arena.ready_time[0] = 10.0
        arena.lease_time[0] = 11.0
        arena.state[0] = S.ACTION_READY

    def test_rows_a_killed_step_tore_are_restored(self, arenas):
        arena, watcher = arenas
        self._leased_and_answered(arena, [1, 1])
        watcher.begin(0)  # the shadow holds [1, 1]
        arena.request["obs"][0, 0] = 2  # the step died half-way through writing its observation
        assert watcher.takeover(0) is False
        assert arena.request["obs"][0].tolist() == [1, 1] and arena.busy_since[0] == 0

    def test_a_step_that_had_not_begun_leaves_the_rows(self, arenas):
        arena, watcher = arenas
        self._leased_and_answered(arena, [1, 1])
        watcher.begin(0)
        arena.request["obs"][0] = torch.tensor([5, 5])  # a later record, published and leased
        arena.ready_time[0], arena.lease_time[0] = time.monotonic() + 1, time.monotonic() + 2
        assert watcher.takeover(0) is False and arena.request["obs"][0].tolist() == [5, 5]

    def test_a_record_written_but_not_published_is_published(self, arenas):
        arena, watcher = arenas
        self._leased_and_answered(arena, [1, 1])
        watcher.begin(0)
        arena.request["obs"][0] = torch.tensor([2, 2])
        arena.ready_time[0] = time.monotonic() + 1  # publication began: ready_time is written first
        assert watcher.takeover(0) is True and arena.request["obs"][0].tolist() == [2, 2]

    def test_a_transition_complete_in_its_chunk_means_a_whole_record(self, arenas):
        arena, watcher = arenas
        self._leased_and_answered(arena, [1, 1])
        lengths = np.zeros(2, np.int32)
        watcher.begin(0, chunk_row=4 + 2)  # chunk 1 of 4 rows, row 2
        arena.request["obs"][0] = torch.tensor([2, 2])
        assert watcher.takeover(0, lengths, 4) is False  # the transition not written: restored
        assert arena.request["obs"][0].tolist() == [1, 1]
        watcher.begin(0, chunk_row=4 + 2)
        arena.request["obs"][0] = torch.tensor([2, 2])
        lengths[1] = 3  # its transition was copied into the chunk, from the stored record
        assert watcher.takeover(0, lengths, 4) is True and arena.request["obs"][0].tolist() == [2, 2]


class _Fd:
    def __init__(self, fd):
        self.fd = fd


@pytest.mark.slow
def test_long_run_with_every_kind_of_fault_is_exact(dev_shm_guard):
    """>= 200k oracle-checked transitions through >= 20 faults of each kind: envs that raise in a
    step or a reset, workers SIGKILLed, steps that hang past step_timeout, and the inference
    server process SIGKILLed."""
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    rng = random.Random(1)
    factories = [functools.partial(OracleEnv, env_id=i, fail_at_step=997 + 31 * i, fail_on_reset=211,
                                   hang_at_step=4001 + 7 * i if i % 4 == 0 else None) for i in range(16)]
    c = AsyncPoolCollector(factories, policy_factory=OracleTagPolicy, frames_per_batch=2000, total_frames=200_000,
                           envs_per_worker=2, step_timeout=0.5, **UNLIMITED)
    servers = set()
    kill_worker = _killer(c._pool, rng)

    def fault(k):
        if k % 4 != 3:
            return kill_worker(k)
        try:
            os.kill(c.server.pid, signal.SIGKILL)
            servers.add(c.server.pid)
        except ProcessLookupError:  # killed by the last fault, not yet replaced
            pass

    try:
        checker = OracleChecker()
        frames = _collect_checked(c, checker, every=1, fault=fault)
        assert frames == checker.records == 200_000
        assert len(kill_worker.pids) >= 20 and len(servers) >= 20
        # (a server killed after the last batch is not replaced; the hung steps' kills are worker
        # restarts too, and every killed worker is replaced)
        assert c.server_stats()["server_restarts"] >= len(servers) - 1
        assert _await_restarts(c._pool, len(kill_worker.pids)) >= len(kill_worker.pids)
        assert c.pool_metrics()["env_restarts"] >= 100 and checker.restarts >= 100
    finally:
        c.shutdown()


@pytest.mark.parametrize("script", ["ppo_cartpole", "impala_cartpole", "dqn_cartpole"])
def test_example_scripts_take_step_timeout(script, capsys):
    from conftest import load_script

    module = load_script(script)
    assert module.parse_config([]).step_timeout == 0.0  # no limit
    assert module.parse_config(["--step-timeout", "30", "--on-env-failure", "restart"]).step_timeout == 30.0
    with pytest.raises(SystemExit) as info:
        module.parse_config(["--step-timeout", "-1"])
    assert info.value.code == 2 and "--step-timeout must be >= 0" in capsys.readouterr().err


def test_ppo_restarts_vector_envs_too():
    from conftest import load_script

    cfg = load_script("ppo_cartpole").parse_config(["--vector-envs", "4", "--on-env-failure", "restart"])
    assert cfg.vector_envs == 4 and cfg.on_env_failure == "restart"
