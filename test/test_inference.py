"""The inference server: exact actions with padding, recurrent state, weight sync, batch keys, faults.

Every test owns its pool and server through context managers, so a failing assertion never
leaves processes behind. Timing bounds are generous (the machine is small and shared): where
the requirement is "within 2 s" the assertion allows ~6 s.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from conftest import oracle_factories
from torchrl_asyncpool import AsyncEnvPool, InferenceServer, InferenceServerError, ProcessSlotTransport
from torchrl_asyncpool.collector.acting_policy import ActingPolicy
from torchrl_asyncpool.errors import EnvError
from torchrl_asyncpool.inference import STAT_KEYS, bucket_ladder
from torchrl_asyncpool.inference._common import KeyPlan, auto_threshold, pick_bucket
from torchrl_asyncpool.inference._runner import KeyRunner
from torchrl_asyncpool.inference._shared import SharedWeights
from torchrl_asyncpool.inference.examples import GRUPolicy, JsonlRecorder, MLPPolicy, read_jsonl
from torchrl_asyncpool.testing.policies import OracleTagPolicy, RaisingPolicy
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action

_PROMPT_S = 6.0  # "within 2 s", with margin for a loaded machine
_VERSION = {"policy_version": ((), torch.int64)}


# -- helpers ------------------------------------------------------------------------------------
def _serve_until(server, frames, timeout=60.0, key=None):
    """Polls the server (raising its errors) until it answered ``frames`` records."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        got = s["frames"] if key is None else s["per_key"][key]["frames"]
        if got >= frames:
            return s
        assert time.monotonic() < deadline, f"server answered {got}/{frames} records in {timeout}s: {s}"
        time.sleep(0.005)


class Recorder:
    """Thread-mode ``on_batch`` hook: keeps a copy of every answered record."""

    def __init__(self):
        self.rows = []
        self.lock = threading.Lock()

    def __call__(self, name, request, response):
        req = {k: request.get(k).clone() for k in ("env_index", "tag", "step_type", "echo", "hidden_in", "observation")
               if request.get(k, None) is not None}
        resp = {k: response.get(k).clone() for k in response.keys()}
        with self.lock:
            for i in range(request.batch_size[0]):
                row = {"key": name}
                row.update({k: v[i] for k, v in req.items()})
                row.update({k: v[i] for k, v in resp.items()})
                self.rows.append(row)


class SpyPolicy(torch.nn.Module):
    """Wraps a policy and records what each call saw: batch size, valid mask, env indices."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = []

    def forward(self, td):
        self.calls.append((td.batch_size[0], td.get("valid_mask").clone(), td.get("env_index").clone()))
        return self.inner(td)


def _check_echo_chain(rows):
    """The env received exactly the action the server recorded for the previous record of that env."""
    last = {}
    for row in rows:
        e = int(row["env_index"])
        if int(row["tag"][2]) > 0:
            assert int(row["echo"]) == last[e], f"env {e}: echo {int(row['echo'])}, server sent {last[e]}"
        last[e] = int(row["action"])


def _single(policy, record: dict):
    """The policy called on one observation alone (batch of 1, no padding)."""
    td = TensorDict({k: v.unsqueeze(0).clone() for k, v in record.items()}, [1])
    td.set("valid_mask", torch.ones(1, dtype=torch.bool))
    with torch.no_grad():
        return policy(td)


def _oracle_obs(tag):
    tag = torch.as_tensor(tag)
    return {"tag": tag, "observation": tag[:1].float().expand(2).clone(), "env_index": tag[0].clone()}


# -- units: bucket ladders and the flush rule ---------------------------------------------------
def test_bucket_ladder_and_pick():
    assert bucket_ladder(1) == (1,)
    assert bucket_ladder(6) == (1, 2, 4, 6)
    assert bucket_ladder(16) == (1, 2, 4, 8, 16)
    assert bucket_ladder(5, (4, 2, 4)) == (2, 4)
    assert bucket_ladder(5, None) is None
    with pytest.raises(ValueError):
        bucket_ladder(5, "pow2")
    with pytest.raises(ValueError):
        bucket_ladder(5, (0, 2))
    assert [pick_bucket((1, 2, 4, 6), b) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert pick_bucket(None, 3) == 3
    assert auto_threshold(8, 1, 0.5) == 4 and auto_threshold(1, 1, 0.5) == 1 and auto_threshold(0, 2, 0.5) == 2


def test_absent_optional_modules_are_remembered_once():
    """A probe for a module that is not installed (tensordict's pandas probe, once per policy
    output and call) answers from ``sys.modules`` after ``remember_absent``, and importing it
    still raises ``ModuleNotFoundError``; installed or imported modules are left alone."""
    import importlib
    import importlib.util

    from torchrl_asyncpool._sys.absent_modules import remember_absent

    name = "torchrl_asyncpool_surely_absent_module"
    try:
        assert remember_absent([name, "json", "tensordict"]) == [name]
        assert sys.modules[name] is None and importlib.util.find_spec(name) is None
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
        assert remember_absent([name]) == []
        assert sys.modules["json"] is json
    finally:
        sys.modules.pop(name, None)
    with pytest.raises(ValueError, match="top-level"):
        remember_absent(["os.path"])
    # a key runner records the serving path's probes: pandas is then imported or known absent
    KeyRunner(KeyPlan(0, "pi", "h", [0], None, 1), MLPPolicy(), _REQ, [(("action",), (), torch.int64)],
              device="cpu")
    assert "pandas" in sys.modules


_REQ = [(("tag",), (3,), torch.int64), (("observation",), (2,), torch.float32), (("step_type",), (), torch.int8)]


def test_the_dry_run_names_a_float_dtype_mismatch_and_the_fix():
    """A float32 network on float64 observations (gymnasium's MuJoCo) fails inside F.linear with
    an error naming neither side; the dry run's error names the entry, both dtypes and the fixes."""
    from tensordict.nn import TensorDictModule

    n = 4
    req = [(("observation",), (3,), torch.float64), (("reward",), (1,), torch.float32),
           (("step_type",), (), torch.int8)]
    arena = TensorDict({"observation": torch.zeros(n, 3, dtype=torch.float64), "reward": torch.zeros(n, 1),
                        "step_type": torch.zeros(n, dtype=torch.int8)}, [n])
    policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action"])

    def runner(p):
        return KeyRunner(KeyPlan(0, "p", "h", list(range(n)), None, n), p, req,
                         [(("action",), (2,), torch.float32)], device="cpu", arena_request=arena)

    with pytest.raises(ValueError) as info:
        runner(policy).dry_run()
    text = str(info.value)
    assert "policy 'p' failed on a zero batch" in text and "'observation': (3,) float64" in text, text
    assert "observations are float64 ('observation') but the policy's parameters are float32" in text, text
    assert "DtypeObservation(env, numpy.float32)" in text and "DoubleToFloat" in text, text
    # a served policy writes its actions in the pool's dtypes itself: casting it is not offered
    assert "policy.to(" not in text, text
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("buckets", ["auto", None, (4,), (3, 8), (1,), (2, 5)])
@pytest.mark.parametrize("policy_cls", [OracleTagPolicy, MLPPolicy])
def test_padded_batches_give_the_same_actions_as_single_calls(buckets, policy_cls):
    """Every batch size 1..8 through every ladder: outputs equal per-observation calls, padding masked."""
    n = 8
    gen = torch.Generator().manual_seed(0)
    arena = TensorDict(
        {
            "tag": torch.randint(0, 50, (n, 3), generator=gen),
            "observation": torch.randn(n, 2, generator=gen),
            "step_type": torch.zeros(n, dtype=torch.int8),
        },
        [n],
    )
    policy = policy_cls()
    spy = SpyPolicy(policy)
    ladder = bucket_ladder(n, buckets)
    max_rows = n if ladder is None else min(n, ladder[-1])
    runner = KeyRunner(KeyPlan(0, "p", "h", list(range(n)), ladder, max_rows), spy, _REQ,
                       [(("action",), (), torch.int64)], device="cpu", arena_request=arena)
    runner.dry_run()
    expected = torch.stack([_single(policy, {"tag": arena["tag"][i],
                                             "observation": arena["observation"][i]})["action"][0]
                            for i in range(n)])
    for b in range(1, max_rows + 1):
        idx = torch.randperm(n, generator=gen)[:b]
        spy.calls.clear()
        action = runner.finish(runner.launch(idx))[("action",)]
        assert torch.equal(action, expected[idx]), (b, action, expected[idx])
        (size, mask, env_index), = spy.calls
        assert size == pick_bucket(ladder, b)
        assert mask.tolist() == [True] * b + [False] * (size - b)
        assert torch.equal(env_index[:b], idx)


@pytest.mark.parametrize(
    "policy_cls,buckets,max_get",
    [(OracleTagPolicy, "auto", None), (MLPPolicy, None, 4), (OracleTagPolicy, (3, 5), None)],
)
def test_server_actions_match_single_calls_end_to_end(policy_cls, buckets, max_get):
    """Oracle pool driven by the server: every record checked, every action equal to a single call."""
    policy = policy_cls()
    spy = SpyPolicy(policy)
    rec = Recorder()
    reference = {}

    def single_action(tag):
        key = tuple(int(x) for x in tag)
        if key not in reference:
            reference[key] = int(_single(policy, _oracle_obs(tag))["action"][0])
        return reference[key]

    checker = OracleChecker(policy=single_action)
    with AsyncEnvPool(oracle_factories(8, step_delay=0.001), envs_per_worker=4) as pool:
        with InferenceServer(
            spy, bucket_sizes=buckets, max_get=max_get, timeout=0.002, on_batch=rec
        ).start(pool) as server:
            _serve_until(server, 400)
            ladder = server.bucket_sizes["policy"]
            stats = server.stats()
    for row in rec.rows:
        checker.observe(int(row["env_index"]), row["tag"], row["step_type"], echo=row["echo"])
        assert int(row["action"]) == single_action(row["tag"])
    assert checker.records >= 400 and checker.episodes_done > 8
    sizes = {size for size, _, _ in spy.calls[1:]}  # [0] is the start-up dry run
    if ladder is None:
        assert max(sizes) <= (max_get or 8)
    else:
        assert sizes <= set(ladder), (sizes, ladder)
        assert max(sizes) <= 5 if buckets == (3, 5) else True
    for size, mask, env_index in spy.calls:
        b = int(mask.sum())
        assert mask.shape == env_index.shape == (size,)  # the unpadded path's cached mask rows too
        assert mask[:b].all() and not mask[b:].any()
    assert 0.0 <= stats["padding_fraction"] < 1.0


def test_double_buffered_loop_on_cpu():
    """The overlapped (CUDA-style) loop order also gives exactly-once, correctly routed actions."""
    rec = Recorder()
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(6), envs_per_worker=3) as pool:
        with InferenceServer(OracleTagPolicy(), double_buffer=True, on_batch=rec).start(pool) as server:
            _serve_until(server, 300)
            serving = [t.native_id for t in threading.enumerate() if t.name.startswith("torchrl_asyncpool-inference")]
            assert server.serving_thread_id in serving  # what the collector's CPU plan weighs
        assert server.serving_thread_id is None  # stopped
    for row in rec.rows:
        checker.observe(int(row["env_index"]), row["tag"], row["step_type"], echo=row["echo"])
    assert checker.records >= 300


@pytest.mark.parametrize("config", ["buckets", "two_keys", "double_buffer", "unpadded"])
def test_each_record_is_gathered_once(config):
    """Where each key's runner gathers its records from the slots into its own staging (padded
    buckets, several keys, double buffering, and CUDA, which takes the same path), the lease copies
    no record: one gather per record. Unpadded on CPU the leased batch itself feeds the policy.
    Either way every record is answered exactly once with its own action."""
    rec, checker = Recorder(), OracleChecker()
    kwargs = {"buckets": {"bucket_sizes": (2, 4)}, "double_buffer": {"double_buffer": True, "bucket_sizes": None},
              "unpadded": {"bucket_sizes": None},
              "two_keys": {"policies": {"a": OracleTagPolicy(), "b": OracleTagPolicy()}, "slot_keys": ["a", "b"] * 3,
                           "bucket_sizes": None}}[config]
    policy = None if config == "two_keys" else OracleTagPolicy()
    with AsyncEnvPool(oracle_factories(6), envs_per_worker=3) as pool:
        with InferenceServer(policy, on_batch=rec, **kwargs).start(pool) as server:
            _serve_until(server, 200)
            staged = set(server._backend.loop.consumer._staging.keys()) - {"env_index"}
    # on_batch hooks see every entry, so an unpadded lease carries all of them
    assert staged == ({"tag", "echo", "observation", "reward", "step_type", "done", "terminated", "truncated"}
                      if config == "unpadded" else set())
    for row in rec.rows:
        checker.observe(int(row["env_index"]), row["tag"], row["step_type"], echo=row["echo"])
        assert int(row["action"]) == int(oracle_action(row["tag"]))
    assert checker.records >= 200
    _check_echo_chain(rec.rows)


class _KeySpy(torch.nn.Module):
    """Answers the oracle's action and notes which keys each batch carried."""

    def __init__(self, in_keys=None):
        super().__init__()
        if in_keys is not None:
            self.in_keys = in_keys
        self.seen = []

    def forward(self, td):
        self.seen.append(set(td.keys()))
        return td.set("action", oracle_action(td["tag"]))


def test_batches_carry_only_what_the_policies_declare_they_read(tmp_path):
    """A policy with ``in_keys`` gets those entries (plus env_index and valid_mask): the rest of
    each record is never copied out of its slot; without ``in_keys``, or with an ``on_batch``
    hook that may read anything, batches carry every entry."""
    everything = {"tag", "echo", "observation", "reward", "step_type", "done", "terminated", "truncated"}
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2) as pool:
        for in_keys, on_batch, want in ((["tag"], None, {"tag"}), (None, None, everything),
                                        (["tag"], Recorder(), everything)):
            spy = _KeySpy(in_keys)
            with InferenceServer(spy, on_batch=on_batch).start(pool) as server:
                _serve_until(server, 100)
            assert spy.seen[1:] and all(keys == want | {"env_index", "valid_mask"} for keys in spy.seen[1:]), (
                in_keys, spy.seen[-1])
    log = tmp_path / "keys.jsonl"
    with AsyncEnvPool(oracle_factories(2)) as pool:  # process mode: the server process restricts too
        factory = functools.partial(_KeyLogPolicy, str(log))
        with InferenceServer(policy_factory=factory, mode="process").start(pool) as server:
            _serve_until(server, 50)
    seen = [set(json.loads(line)) for line in log.read_text().splitlines()]
    assert len(seen) > 1 and all(keys == {"tag", "env_index", "valid_mask"} for keys in seen[1:]), seen[-1]


class _KeyLogPolicy(OracleTagPolicy):
    """Declares ``in_keys = ["tag"]`` and appends the keys of each batch it sees to a file (one
    JSON list a line), so that a server process's batches can be checked from the test."""

    in_keys = ["tag"]

    def __init__(self, path):
        super().__init__()
        self.path = path

    def forward(self, td):
        with open(self.path, "a") as f:
            f.write(json.dumps(sorted(td.keys())) + "\n")
        return super().forward(td)


# -- flush rule ---------------------------------------------------------------------------------
def test_deadline_flushes_partial_batches_and_self_sizing():
    """One very slow env must not hold the others back (full OR deadline), in both sizing modes."""
    per_env = [functools.partial(OracleEnv, env_id=i, step_delay=(0.4 if i == 0 else 0.0)) for i in range(4)]
    with AsyncEnvPool(per_env, envs_per_worker=1) as pool:
        for max_get in (4, None):
            with InferenceServer(OracleTagPolicy(), max_get=max_get, timeout=0.01).start(pool) as server:
                s = _serve_until(server, 150, timeout=30)
                assert s["mean_batch_size"] < 4
                assert s["queueing_time_s"] < 0.5, s


def test_an_auto_deadline_is_waited_for_deaf_to_records_but_not_to_a_stop():
    """timeout="auto" waiting: once a record is ready the deadline alone ends the wait (the loop's
    wait leaves the workers' doorbell out until then); fewer ready than min_get, or an explicit
    timeout, listen; a stop ends the deaf wait at once."""
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=1) as pool:
        server = InferenceServer(OracleTagPolicy(), timeout="auto", mode="thread").start(pool, hold=True)
        try:
            loop = server._backend.loop
            assert loop.consumer.wait_ready(4, timeout=30) == 4  # held: the records wait in their slots
            loop.deadline = None  # the chooser's choice held by hand: wait 30 s, no flush size reached
            loop.timeout, loop.max_get = 30.0, 100
            oldest = loop.consumer.scan_states()[3]
            now = time.monotonic()
            assert loop._due(now) == pytest.approx(oldest + 30.0 - now)
            assert loop._wait.deaf_until == pytest.approx(oldest + 30.0)
            loop.min_get = 8  # fewer ready than min_get: only a publication can make a batch due
            assert loop._due(now) == float("inf") and loop._wait.deaf_until == 0.0
            loop.min_get = 1
            loop._due(now)
            assert loop._wait.deaf_until > now
            loop.auto_timeout = False  # an explicit timeout: the wait listens to every record
            assert loop._due(now) > 0 and loop._wait.deaf_until == 0.0
            loop.auto_timeout = True
            result = []
            waiter = threading.Thread(target=lambda: result.append(loop.wait_flush()))
            waiter.start()
            time.sleep(0.3)
            assert waiter.is_alive() and loop._wait.deaf_until > time.monotonic() + 20  # deaf, 30 s to go
            t0 = time.monotonic()
            server.stop()
            waiter.join(_PROMPT_S)
            assert not waiter.is_alive() and result == [False], "a stop must end a deaf wait"
            assert time.monotonic() - t0 < _PROMPT_S
        finally:
            server.stop()


# -- recurrent state ----------------------------------------------------------------------------
def test_gru_state_is_carried_in_the_slot_and_reset_on_first():
    hidden = 8
    policy = GRUPolicy(obs_dim=2, hidden=hidden)
    rec = Recorder()
    with AsyncEnvPool(
        oracle_factories(6, step_delay=0.001), envs_per_worker=3,
        policy_output_spec={"hidden_out": ((hidden,), torch.float64)}, recurrent_state={"hidden_in": "hidden_out"},
    ) as pool:
        with InferenceServer(policy, timeout=0.002, on_batch=rec).start(pool) as server:
            _serve_until(server, 300)
    _check_echo_chain(rec.rows)
    by_env = {}
    for row in rec.rows:
        by_env.setdefault(int(row["env_index"]), []).append(row)
    carried = resets = 0
    for env, rows in by_env.items():
        h = None
        for row in rows:
            step = int(row["tag"][2])
            if step == 0:
                assert not row["hidden_in"].any(), f"env {env}: hidden_in not reset on FIRST"
                h = torch.zeros(hidden, dtype=torch.float64)
                resets += 1
            else:
                assert torch.equal(row["hidden_in"], h), f"env {env} step {step}: hidden_in is not the last hidden_out"
                carried += 1
            ref = _single(policy, {**_oracle_obs(row["tag"]), "hidden_in": h})
            assert torch.allclose(row["hidden_out"], ref["hidden_out"][0], rtol=0, atol=1e-12)
            assert int(row["action"]) == int(ref["action"][0])
            h = row["hidden_out"]
    assert carried > 50 and resets > 6


# -- weights ------------------------------------------------------------------------------------
def test_weight_update_without_restart_thread_mode():
    rec = Recorder()
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=4, policy_output_spec=_VERSION) as pool:
        server = InferenceServer(OracleTagPolicy(), on_batch=rec)
        assert server.update_policy_weights_(OracleTagPolicy(offset=2)) == 1  # before start: applied in place
        with server.start(pool):
            _serve_until(server, 100)
            assert server.update_policy_weights_(OracleTagPolicy(offset=3), wait=True) == 2
            _serve_until(server, 200)
            # a TensorDict of parameters works too, with an explicit version
            weights = TensorDict.from_module(OracleTagPolicy(offset=7))
            assert server.update_policy_weights_(weights, version=5, wait=True) == 5
            s = _serve_until(server, 300)
            assert s["policy_versions"] == {"policy": 5} and s["weight_updates"] == 2
            with pytest.raises(KeyError, match="do not match"):
                server.update_policy_weights_({"nope": torch.zeros(1)})
    offsets = {1: 2, 2: 3, 5: 7}
    seen = set()
    for row in rec.rows:
        v = int(row["policy_version"])
        seen.add(v)
        assert int(row["action"]) == (int(oracle_action(row["tag"])) + offsets[v]) % 1000
    assert seen == {1, 2, 5}
    _check_echo_chain(rec.rows)
    versions = [int(r["policy_version"]) for r in rec.rows]
    assert versions == sorted(versions), "a batch was served with older weights after a newer version"


def test_weight_update_without_restart_process_mode(tmp_path):
    path = str(tmp_path / "log.jsonl")
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=4, policy_output_spec=_VERSION) as pool:
        server = InferenceServer(policy_factory=OracleTagPolicy, on_batch=JsonlRecorder(path))
        server.update_policy_weights_(OracleTagPolicy(offset=1))  # before start: sent once it runs
        with server.start(pool):
            assert server.mode == "process" and server.pid != os.getpid()
            assert server.serving_thread_id is None  # no serving thread in this process
            _serve_until(server, 100)
            server.update_policy_weights_(OracleTagPolicy(offset=3), wait=True)
            _serve_until(server, 200)
            server.update_policy_weights_(OracleTagPolicy(offset=9).state_dict(), wait=True)
            s = _serve_until(server, 300)
            assert s["policy_versions"] == {"policy": 3}
            with pytest.raises(ValueError, match="shape"):
                bad = OracleTagPolicy()
                bad.offset = torch.nn.Parameter(torch.zeros(2))
                server.update_policy_weights_(bad)
    rows = read_jsonl(path)
    assert len(rows) >= 300
    offsets = {0: 0, 1: 1, 2: 3, 3: 9}
    for row in rows:
        assert row["action"] == (int(oracle_action(torch.tensor(row["tag"]))) + offsets[row["policy_version"]]) % 1000
    assert {r["policy_version"] for r in rows} >= {1, 2, 3}
    _check_echo_chain([{**r, "tag": torch.tensor(r["tag"])} for r in rows])


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_weights_given_before_start_or_while_held_act_from_the_first_batch(mode, tmp_path):
    """Pending weights are published before the server leases anything (a process server used to
    serve a first batch before them); start(hold=True) serves nothing until release()."""

    def served_offsets(path):
        rows = read_jsonl(path)
        assert len(rows) >= 40
        return {(r["action"] - int(oracle_action(torch.tensor(r["tag"])))) % 1000 for r in rows}, {
            r["policy_version"] for r in rows}

    def server_for(path):
        hook = JsonlRecorder(path)
        if mode == "thread":
            return InferenceServer(OracleTagPolicy(), on_batch=hook)
        return InferenceServer(policy_factory=OracleTagPolicy, on_batch=hook)

    first, held = str(tmp_path / "first.jsonl"), str(tmp_path / "held.jsonl")
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=4, policy_output_spec=_VERSION) as pool:
        server = server_for(first)
        server.update_policy_weights_(OracleTagPolicy(offset=3))
        with server.start(pool):
            _serve_until(server, 40)
    assert served_offsets(first) == ({3}, {1})
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=4, policy_output_spec=_VERSION) as pool:
        server = server_for(held)
        with server.start(pool, hold=True):
            time.sleep(0.3)
            assert server.stats()["frames"] == 0  # the records wait in their slots
            server.update_policy_weights_(OracleTagPolicy(offset=4))
            server.release()
            server.release()  # idempotent
            _serve_until(server, 40)
    assert served_offsets(held) == ({4}, {1})
    with AsyncEnvPool(oracle_factories(2), policy_output_spec=_VERSION) as pool:
        server = server_for(held)
        server.start(pool, hold=True)
        t0 = time.monotonic()
        server.stop()  # a held server stops at once
        assert time.monotonic() - t0 < _PROMPT_S


def test_shared_weights_seqlock_drops_torn_reads():
    fd = os.memfd_create("w", os.MFD_CLOEXEC)
    try:
        server = SharedWeights.create(fd, {"pi": {"w": torch.zeros(4)}})
        owner = SharedWeights.attach(fd, server.layout)
        hdr = owner._headers["pi"]
        hdr[0] += 1  # a writer is mid-update: nothing is taken
        assert server.poll() == []
        hdr[0] += 1
        owner._views["pi"][0][1].copy_(torch.ones(4))
        (name, flat, version), = server.poll()
        assert name == "pi" and flat["w"].tolist() == [1.0] * 4
        with pytest.raises(KeyError):
            owner.publish("pi", {"v": torch.zeros(4)}, 1)
    finally:
        os.close(fd)


# -- several policies ---------------------------------------------------------------------------
def test_two_batch_keys_never_mix_and_both_are_served():
    """Key "b" holds one slot of eight and is still served; each policy call holds one key's slots."""
    a, b = SpyPolicy(OracleTagPolicy()), SpyPolicy(OracleTagPolicy(offset=500))
    slot_keys = ["a"] * 7 + ["b"]
    rec = Recorder()
    with AsyncEnvPool(oracle_factories(8), envs_per_worker=4, policy_output_spec=_VERSION) as pool:
        server = InferenceServer(policies={"a": a, "b": b}, slot_keys=slot_keys, max_get=8, timeout=0.005,
                                 policy_configs={"b": {"checkpoint": "b.pt"}}, on_batch=rec)
        with server.start(pool):
            assert set(server.batch_keys) == {"a", "b"}
            assert server.batch_keys["a"].config_hash != server.batch_keys["b"].config_hash
            assert server.bucket_sizes == {"a": (1, 2, 4, 7), "b": (1,)}
            _serve_until(server, 60, key="b")
            s = _serve_until(server, 300)
            assert s["per_key"]["a"]["frames"] >= 200
    for spy, slots in ((a, set(range(7))), (b, {7})):
        assert len(spy.calls) > 10
        for _, _, env_index in spy.calls[1:]:
            assert set(env_index.tolist()) <= slots
    for row in rec.rows:
        offset = 500 if row["key"] == "b" else 0
        assert (int(row["env_index"]) == 7) == (row["key"] == "b")
        assert int(row["action"]) == (int(oracle_action(row["tag"])) + offset) % 1000
    _check_echo_chain(rec.rows)


# -- start-up validation ------------------------------------------------------------------------
def test_bad_configuration_is_refused_at_start_up():
    spec = {"hidden_out": ((4,), torch.float64), "logp": ((), torch.float32), "policy_version": ((), torch.int64)}
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2, policy_output_spec=spec,
                      recurrent_state={"hidden_in": "hidden_out"}) as pool:
        good = GRUPolicy(hidden=4)

        def with_logp(policy):
            def run(td):
                td = policy(td)
                td.set("logp", torch.zeros(td.batch_size, dtype=torch.float32))
                return td
            return run

        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match="num_threads must be None or a positive int"):
                InferenceServer(with_logp(good), num_threads=bad)
        with pytest.raises(ValueError, match="unknown policy 'c'"):
            InferenceServer(policies={"a": with_logp(good), "b": with_logp(good)}, slot_keys=["a", "c"]).start(pool)
        with pytest.raises(ValueError, match="unknown batch key"):
            InferenceServer(policies={"a": with_logp(good)}, slot_keys=[("a", "0" * 12)] * 2).start(pool)
        with pytest.raises(ValueError, match="slot_keys"):
            InferenceServer(policies={"a": with_logp(good), "b": with_logp(good)}).start(pool)
        with pytest.raises(ValueError, match="2 env slots"):
            InferenceServer(policies={"a": with_logp(good)}, slot_keys=["a"]).start(pool)
        with pytest.raises(ValueError, match="'logp'"):
            InferenceServer(good).start(pool)  # misses a declared policy output
        with pytest.raises(ValueError, match="'action'"):
            InferenceServer(
                lambda td: td.set("hidden_out", td["hidden_in"]).set("logp", torch.zeros(td.shape))
            ).start(pool)
        with pytest.raises(ValueError, match="recurrent state"):
            InferenceServer(with_logp(GRUPolicy(hidden=8))).start(pool)  # hidden size 8, pool carries 4
        with pytest.raises(ValueError, match="dtype torch.float64"):
            InferenceServer(with_logp(GRUPolicy(hidden=4, dtype=torch.float32))).start(pool)
        with pytest.raises(ValueError, match="timeout"):
            InferenceServer(good, timeout=None)
        with pytest.raises(ValueError, match="factories"):
            InferenceServer(good, mode="process")
        # the same checks run in a server process and come back as text
        with pytest.raises(ValueError, match="'logp'"):
            InferenceServer(policy_factory=functools.partial(GRUPolicy, hidden=4)).start(pool)
        # after all these refusals the pool is untouched and serves a good configuration
        with InferenceServer(with_logp(good)).start(pool) as server:
            _serve_until(server, 50)
    with AsyncEnvPool(oracle_factories(1), policy_output_spec={"policy_version": ((), torch.float32)}) as pool:
        with pytest.raises(ValueError, match="stamps the policy version"):
            InferenceServer(OracleTagPolicy()).start(pool)


def _openmp_runtime():
    """The OpenMP runtime torch loaded (``omp_get_max_threads`` is per thread), or ``None``."""
    import ctypes

    torch.ones(2) @ torch.ones(2)  # make sure the runtime is loaded
    libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libiomp" in line})
    return ctypes.CDLL(libs[0]) if libs else None


class _ThreadCountProbe(OracleTagPolicy):
    def __init__(self, omp):
        super().__init__()
        self.omp, self.seen = omp, set()

    def forward(self, td):
        if threading.current_thread() is not threading.main_thread():  # not start()'s dry run
            self.seen.add(int(self.omp.omp_get_max_threads()))
        return super().forward(td)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize(
    "caller, num_threads, expected",
    [(2, "default", 1), (2, 2, 2), (2, None, 2), (1, None, 1)],
)
def test_thread_server_torch_thread_count(caller, num_threads, expected):
    """OpenMP thread counts are per thread. The serving thread runs at ``num_threads`` (default 1,
    whatever the caller's count), or with ``None`` at the caller's count (a new thread would
    otherwise start a team of one thread per core on its first parallel op); the caller's own
    count is left as it was."""
    omp = _openmp_runtime()
    if omp is None:
        pytest.skip("torch was not built with an OpenMP runtime")
    before = torch.get_num_threads()
    torch.set_num_threads(caller)
    try:
        probe = _ThreadCountProbe(omp)
        kwargs = {} if num_threads == "default" else {"num_threads": num_threads}
        with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
            with InferenceServer(probe, **kwargs).start(pool) as server:
                _serve_until(server, 20)
        assert probe.seen == {expected}
        assert torch.get_num_threads() == caller
    finally:
        torch.set_num_threads(before)


class _GradProbe(OracleTagPolicy):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))  # requires grad: a graph would be built if grad were on
        self.seen = set()

    def forward(self, td):
        if threading.current_thread() is not threading.main_thread():  # not start()'s dry run
            self.seen.add((torch.is_grad_enabled(), (self.w * 2).requires_grad))
        return super().forward(td)


def test_the_serving_thread_runs_policies_without_grad():
    """The serving loop turns grad off once for its own thread (no ``no_grad`` per batch): the
    policy never builds a graph, and the caller's grad mode is its own."""
    probe = _GradProbe()
    hooked = []
    probe.register_forward_hook(lambda *args: hooked.append(1))  # the user's policy keeps its hooks
    assert torch.is_grad_enabled()
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with InferenceServer(ActingPolicy(probe)).start(pool) as server:
            batches = _serve_until(server, 20)["batches"]
            assert torch.is_grad_enabled()
    assert probe.seen == {(False, False)}
    assert len(hooked) >= batches > 0  # once per batch (and per dry run)


# -- faults -------------------------------------------------------------------------------------
def test_policy_error_names_the_key_thread_mode():
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=4) as pool:
        server = InferenceServer(policies={"ok": OracleTagPolicy(), "bad": RaisingPolicy(fail_at_step=2)},
                                 slot_keys=["ok", "ok", "bad", "bad"])
        with server.start(pool):
            t0 = time.monotonic()
            with pytest.raises(InferenceServerError, match="policy 'bad'") as info:
                server.wait(timeout=30)
            assert time.monotonic() - t0 < 30
            assert info.value.key == tuple(server.batch_keys["bad"])
            assert "scripted failure" in str(info.value) and "RaisingPolicy" in info.value.server_traceback
            assert isinstance(info.value.__cause__, RuntimeError)
            with pytest.raises(InferenceServerError):
                server.check()  # sticky
            with pytest.raises(InferenceServerError):
                server.stats()
            assert not server.is_alive
        # delivered already: leaving the block does not raise it a second time


class _WrongDtypeLater(OracleTagPolicy):
    """Passes the start-up dry run, then writes float actions once a record reaches step 3."""

    def forward(self, td):
        td = super().forward(td)
        if bool((td.get("tag")[..., 2] >= 3).any()):
            td.set("action", td.get("action").float())
        return td


def test_policy_output_of_the_wrong_dtype_mid_run_names_key_and_layout():
    """Outputs are checked on every batch (not only at start-up), before anything is written."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with InferenceServer(_WrongDtypeLater()).start(pool) as server:
            with pytest.raises(InferenceServerError, match="'action'.*dtype torch.int64.*given.*torch.float32"):
                server.wait(timeout=30)
        steps = pool._local_consumer().arena.request.get("tag")[:, 2]
        assert int(steps.max()) <= 3  # no action answered the bad batch: no env stepped past it


def test_policy_error_names_the_key_process_mode():
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with InferenceServer(
            policy_factories={"bad": functools.partial(RaisingPolicy, fail_at_step=2)}
        ).start(pool) as server:
            deadline = time.monotonic() + 30
            with pytest.raises(InferenceServerError, match="policy 'bad'") as info:
                while time.monotonic() < deadline:
                    server.check()
                    time.sleep(0.01)
            assert info.value.key == tuple(server.batch_keys["bad"])
            assert "RuntimeError: RaisingPolicy: scripted failure" in info.value.server_traceback


def test_env_error_stops_the_server_with_the_env_named():
    per_env = oracle_factories(2, fail_at_step=5)
    with AsyncEnvPool(per_env, envs_per_worker=2) as pool:
        with InferenceServer(OracleTagPolicy()).start(pool) as server:
            with pytest.raises(InferenceServerError, match="env") as info:
                server.wait(timeout=30)
            assert isinstance(info.value.__cause__, EnvError)


def _refuse_outside(parent_pid):
    if os.getpid() != parent_pid:
        raise ImportError("this factory cannot be rebuilt in the server process")
    return _UnpicklableThere()


class _UnpicklableThere:
    """A policy factory that unpickles only in the process that made it: the server process dies
    inside multiprocessing's bootstrap, before server_main can report anything."""

    def __call__(self):
        return OracleTagPolicy()

    def __reduce__(self):
        return _refuse_outside, (os.getpid(),)


def test_a_server_process_dying_before_it_reports_is_named_promptly():
    """Its status pipe reads EOF (a readable descriptor, so waiting again would spin until the
    start-up timeout): the error comes at once and names the death."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        server = InferenceServer(policy_factory=_UnpicklableThere())
        t0 = time.monotonic()
        with pytest.raises(InferenceServerError, match="died during start-up"):
            server.start(pool)
        assert time.monotonic() - t0 < 60.0  # the start-up timeout is 120 s
        assert not server.is_alive


def test_sigkill_of_the_server_process_is_reported_promptly_and_stop_returns():
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        transport = ProcessSlotTransport(pool, mp_start_method="forkserver")
        server = InferenceServer(policy_factory=OracleTagPolicy).start(transport)
        try:
            _serve_until(server, 50)
            pid = server.pid
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(InferenceServerError, match="killed by signal 9"):
                while time.monotonic() - t0 < 10:
                    server.check()
                    time.sleep(0.005)
            assert time.monotonic() - t0 < _PROMPT_S
            t1 = time.monotonic()
            with pytest.raises(InferenceServerError):
                server.wait(timeout=10)  # never a hang: returns at once with the error
            assert time.monotonic() - t1 < _PROMPT_S
        finally:
            server.stop(raise_errors=False)
        assert not server.is_alive


@pytest.mark.slow
def test_no_orphan_server_process_when_the_owner_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import functools, sys, time
        from torchrl_asyncpool import AsyncEnvPool, InferenceServer
        from torchrl_asyncpool.testing.policies import OracleTagPolicy
        from torchrl_asyncpool.testing import OracleEnv
        if __name__ == "__main__":
            pool = AsyncEnvPool([functools.partial(OracleEnv, env_id=i) for i in range(2)], envs_per_worker=2)
            server = InferenceServer(policy_factory=OracleTagPolicy).start(pool)
            print(server.pid, *pool.worker_pids, flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "owner.py"
    path.write_text(script)
    owner = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in owner.stdout.readline().split()]
        assert pids, "the owner script did not start"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + _PROMPT_S
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), f"orphans left: {[p for p in pids if _alive(p)]}"
    finally:
        if owner.poll() is None:
            owner.kill()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_process_mode_with_spawn_and_one_thread():
    """The spawn context works too, and the server process runs torch with num_threads threads."""

    def factory():
        class ThreadsProbe(OracleTagPolicy):
            def forward(self, td):
                if torch.get_num_threads() != 1:
                    raise RuntimeError(f"server runs {torch.get_num_threads()} intra-op threads")
                return super().forward(td)

        return ThreadsProbe()

    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        transport = ProcessSlotTransport(pool, mp_start_method="spawn", num_threads=1)
        with InferenceServer(policy_factory=factory).start(transport) as server:
            _serve_until(server, 100)
            assert server.pid == transport.pid


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_weight_updates_after_stop_are_refused(mode):
    """A stopped server serves nothing again: new weights would never act, so they are refused
    (thread mode used to return a version that is never served; process mode said KeyError: 'policy')."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        if mode == "thread":
            server = InferenceServer(OracleTagPolicy())
        else:
            server = InferenceServer(policy_factory=OracleTagPolicy)
        with server.start(pool):
            _serve_until(server, 20)
            assert server.update_policy_weights_(OracleTagPolicy(offset=1), wait=True) == 1
        for wait in (False, True):
            with pytest.raises(RuntimeError, match="stopped.*policy 'policy'.*create a new"):
                server.update_policy_weights_(OracleTagPolicy(offset=2), wait=wait, timeout=5)
        assert server.policy_version() == 1
        assert server.stats()["policy_versions"] == {"policy": 1}  # the last stats stay readable


def test_a_second_server_on_a_served_pool_is_refused():
    """Two consumers on one pool lease and answer the same records (seen: 44 records answered
    twice in 8 s by two process servers). A second start is refused until the first stops."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        first = InferenceServer(OracleTagPolicy()).start(pool)
        try:
            _serve_until(first, 20)
            for second in (InferenceServer(OracleTagPolicy()), InferenceServer(policy_factory=OracleTagPolicy)):
                with pytest.raises(RuntimeError, match="already served by InferenceServer.*stop"):
                    second.start(pool)
                assert not second.is_alive
            with pytest.raises(RuntimeError, match="already served"):
                InferenceServer(policy_factory=OracleTagPolicy).start(ProcessSlotTransport(pool))
            _serve_until(first, 40)  # the refusals left the first server alone
        finally:
            first.stop()
        with InferenceServer(policy_factory=OracleTagPolicy).start(pool) as server:  # free again
            _serve_until(server, 20)


def test_the_pools_own_recv_and_send_refuse_while_a_server_serves_it():
    """``pool.recv``/``send`` are a second consumer too: refused while a server of this
    process serves the pool, the caller's again once it stopped."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        server = InferenceServer(OracleTagPolicy()).start(pool)
        try:
            _serve_until(server, 20)
            with pytest.raises(RuntimeError, match="recv: this pool is served by InferenceServer.*stop"):
                pool.recv(timeout=1.0)
            with pytest.raises(RuntimeError, match="send: this pool is served by"):
                pool.send({"action": torch.zeros(1, dtype=torch.int64)}, [0])
            _serve_until(server, 40)  # the refusals left the server alone
        finally:
            server.stop()
        td = pool.recv(min_get=2, timeout=30)  # what the server left ready (or answered) is the caller's now
        pool.send({"action": oracle_action(td["tag"])}, td.env_indices)


def test_a_policy_reading_a_missing_key_is_shown_the_pool_keys():
    """Batches carry only what the policies declare they read; the error for a typo in
    ``in_keys`` still lists every key the pool's records provide (it listed only
    ``env_index`` and ``valid_mask``: none of the pool's keys was read)."""
    from tensordict.nn import TensorDictModule

    typo = TensorDictModule(lambda obs: obs[..., 0].long(), in_keys=["obs"], out_keys=["action"])
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with pytest.raises(ValueError, match="reads \\['obs'\\].*available keys: .*'observation'.*'tag'"):
            InferenceServer(typo).start(pool)
        with pytest.raises(ValueError, match="available keys: .*'observation'"):
            InferenceServer(policy_factory=functools.partial(
                TensorDictModule, torch.nn.Identity(), in_keys=["obs"], out_keys=["action"])).start(pool)
    if not torch.cuda.is_available():  # torch.device(0) is the accelerator's first device
        with pytest.raises(ValueError, match="device=0 .*accelerator"):
            InferenceServer(OracleTagPolicy(), device=0)


def test_careless_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="'policy' is given twice"):
        InferenceServer(OracleTagPolicy(), policies={"policy": OracleTagPolicy(offset=1)})
    with pytest.raises(ValueError, match="'policy' is given twice"):
        InferenceServer(policy_factory=OracleTagPolicy, policy_factories={"policy": OracleTagPolicy})
    with pytest.raises(TypeError, match="on_batch must be callable.*got int"):
        InferenceServer(OracleTagPolicy(), on_batch=3)
    for bad in (None, "0.5", 0, 1.5):
        with pytest.raises(ValueError, match="flush_fraction must be a number in \\(0, 1\\]"):
            InferenceServer(OracleTagPolicy(), flush_fraction=bad)
    with pytest.raises(ValueError, match="mp_start_method must be one of"):
        InferenceServer(policy_factory=OracleTagPolicy, mp_start_method="fork")
    with pytest.raises(ValueError, match="start_timeout must be None or a number of seconds > 0"):
        InferenceServer(policy_factory=OracleTagPolicy, start_timeout=-1)
    with pytest.raises(TypeError, match="policy_configs must be a dict.*got list"):
        InferenceServer(OracleTagPolicy(), policy_configs=[1, 2])
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with pytest.raises(ValueError, match="slot 0 is bound to \\['a', 'x'\\] \\(list\\)"):
            InferenceServer(policies={"a": OracleTagPolicy()}, slot_keys=[["a", "x"]] * 2).start(pool)
        with InferenceServer(OracleTagPolicy()).start(pool) as server:  # the refusals left the pool free
            _serve_until(server, 20)


# -- stats --------------------------------------------------------------------------------------
def test_stats_keys_and_reset():
    with AsyncEnvPool(oracle_factories(4, step_delay=0.004), envs_per_worker=4) as pool:
        with InferenceServer(OracleTagPolicy(), max_get=4).start(pool) as server:
            pool.metrics(reset=True)
            s = _serve_until(server, 100)
            # the server's waits count as idle in the pool's metrics too
            assert pool.metrics()["consumer_busy_fraction"] < 0.9
            assert set(s) == set(STAT_KEYS) | {"mode"}
            assert s["batches"] > 0 and s["batches_per_s"] > 0 and s["frames_per_s"] > 0
            assert 1 <= s["mean_batch_size"] <= 4
            assert 0 <= s["padding_fraction"] < 1
            assert s["inference_time_s"] > 0 and s["queueing_time_s"] >= 0 and s["service_time_s"] > 0
            before = server.stats(reset=True)["frames"]  # the cumulative count, then a new window
            assert before >= s["frames"] >= 100
            # the new window counts only what was served since: fewer than everything before it
            # (a reset that did nothing would count on from `before`)
            assert server.stats()["frames"] < before
    assert repr(server).startswith("InferenceServer(")


class _SlowPolicy(OracleTagPolicy):
    def forward(self, td):
        time.sleep(0.002)
        return super().forward(td)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_busy_server_still_stops_promptly(mode):
    """Inference-bound: a batch is always due, yet stop() returns and leaves no slot leased."""
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=4) as pool:
        if mode == "thread":
            server = InferenceServer(_SlowPolicy(), max_get=1, timeout=0.0)
        else:
            server = InferenceServer(policy_factory=_SlowPolicy, max_get=1, timeout=0.0)
        server.start(pool)
        try:
            _serve_until(server, 50)
        finally:
            t0 = time.monotonic()
            server.stop()
        assert time.monotonic() - t0 < _PROMPT_S
        td = pool.recv(min_get=4, max_get=4, timeout=10)  # all four answered and stepped: none leased
        assert sorted(td.env_indices.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_stop_without_a_timeout_waits_and_releases_everything(mode):
    """``stop(timeout=None)`` (TorchRL's ``shutdown(None)``) waits for the batch in hand; process
    mode raised TypeError from the exit wait, leaving the server process a zombie and its monitor,
    pipes and shared blocks open."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        if mode == "thread":
            server = InferenceServer(OracleTagPolicy())
        else:
            server = InferenceServer(policy_factory=OracleTagPolicy)
        server.start(pool)
        _serve_until(server, 20)
        pid = server.pid
        server.shutdown(timeout=None)
        assert not server.is_alive
        if pid is not None:
            assert not _alive(pid) and server._backend._proc.exitcode == 0
            assert server._backend._stats_fd == -1 and not server._backend._monitor.is_alive()
        td = pool.recv(min_get=2, max_get=2, timeout=10)  # nothing left leased
        assert td.batch_size[0] == 2


def test_stop_leaves_the_pool_usable():
    """A stopped server finishes its batch: the caller (or another server) can take over."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with InferenceServer(OracleTagPolicy()).start(pool) as server:
            _serve_until(server, 30)
        td = pool.recv(min_get=2, max_get=2, timeout=10)
        assert td.batch_size[0] == 2
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, [2]), td.env_indices)
        with InferenceServer(policy_factory=OracleTagPolicy).start(pool) as server:
            _serve_until(server, 30)


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_path_matches_single_cpu_calls(cuda_graphs):
    policy = MLPPolicy()
    cpu_policy = MLPPolicy()
    rec = Recorder()
    with AsyncEnvPool(oracle_factories(8), envs_per_worker=4) as pool:
        with InferenceServer(policy, device="cuda", cuda_graphs=cuda_graphs, on_batch=rec).start(pool) as server:
            _serve_until(server, 300)
    for row in rec.rows:
        assert int(row["action"]) == int(_single(cpu_policy, _oracle_obs(row["tag"]))["action"][0])
    _check_echo_chain(rec.rows)


