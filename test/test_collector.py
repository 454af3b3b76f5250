"""AsyncPoolCollector: exactly-once, in-order delivery through iteration, replay buffers and start()."""
import threading
import time

import gymnasium
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import AsyncBatchedCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer

from conftest import oracle_factories, start_and_check, thread_names
from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.testing import OracleChecker, oracle_action


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


@pytest.mark.parametrize("env_threads", [False, True])
def test_is_an_async_batched_collector_and_iterates_exactly(env_threads, dev_shm_guard):
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(8, step_delay=0.001 if env_threads else 0.0), policy=oracle_policy,
                           frames_per_batch=50, total_frames=230, envs_per_worker=4, env_threads=env_threads,
                           transition_chunk_size=7)
    try:
        assert isinstance(c, AsyncBatchedCollector)
        sizes = []
        for batch in c:
            sizes.append(batch.shape[0])
            checker.observe_transitions(batch)
            assert batch["policy_version"].eq(0).all()
            assert ("next", "done") in batch.keys(True) and ("next", "terminated") in batch.keys(True)
        assert sizes == [50, 50, 50, 50, 30]  # the total frame count is exact
        assert checker.records == 230
    finally:
        c.shutdown()


class _OracleModule(torch.nn.Module):
    def forward(self, tag):
        return oracle_action(tag)


def test_a_policy_reading_only_its_in_keys_still_delivers_whole_transitions():
    """The serving thread stages only the policy's in_keys; the transitions come from the
    workers' chunks and keep every entry."""
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(_OracleModule(), in_keys=["tag"], out_keys=["action"])
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(4), policy=policy, frames_per_batch=40, total_frames=200)
    try:
        for batch in c:
            checker.observe_transitions(batch)  # reads tag, echo, reward, flags, ("next", ...)
            assert batch["observation"].shape == (40, 2) and batch["next", "observation"].shape == (40, 2)
        assert checker.records == 200
    finally:
        c.shutdown()


@pytest.mark.parametrize("nested", [False, True])
def test_a_policy_reading_a_key_the_env_lacks_is_refused_by_name_before_any_worker(nested):
    """Calling such a TensorDictModule would hand its module ``None`` (``strict=False``) and fail
    inside it; the collector names the key and what the records hold instead."""
    from tensordict.nn import TensorDictModule

    key = ("agent", "obs") if nested else "obs"
    policy = TensorDictModule(_OracleModule(), in_keys=[key], out_keys=["action"])
    with pytest.raises(ValueError) as info:
        AsyncPoolCollector(oracle_factories(2), policy=policy, frames_per_batch=8)
    text = str(info.value)
    assert f"the policy reads [{key!r}], which the env's records do not provide" in text, text
    assert "'observation'" in text and "'tag'" in text, text


class _Float64ObservationEnv(gymnasium.Env):
    """gymnasium's MuJoCo envs in one respect: float64 observations, float32 actions."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float64)
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3), {}

    def step(self, action):
        return np.full(3, 0.5), 1.0, False, False, {}


def test_a_float32_policy_on_float64_observations_is_refused_with_both_dtypes_and_the_fixes(dev_shm_guard):
    """The constructor runs the policy on a zero record before any worker starts; a dtype
    mismatch failed there with torch's bare "mat1 and mat2 must have the same dtype"."""
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action"])
    with pytest.raises(ValueError) as info:
        AsyncPoolCollector([_Float64ObservationEnv] * 2, policy=policy, frames_per_batch=8)
    text = str(info.value)
    assert "the policy failed on a zero record built from the env's specs" in text, text
    assert "'observation': (3,) float64" in text and "same dtype" in text, text
    assert "observations are float64 ('observation') but the policy's parameters are float32" in text, text
    assert "DtypeObservation(env, numpy.float32)" in text and "policy.to(torch.float64)" in text, text
    assert isinstance(info.value.__cause__, RuntimeError)
    # the second fix runs (float64 actions cast to the env's float32)
    c = AsyncPoolCollector([_Float64ObservationEnv] * 2, policy=policy.to(torch.float64), frames_per_batch=8,
                           total_frames=16)
    try:
        batches = list(c)
    finally:
        c.shutdown()
    assert [b["observation"].dtype for b in batches] == [torch.float64] * 2
    assert batches[0]["action"].dtype == torch.float32


def test_a_policy_that_raises_at_start_up_is_reported_with_the_record_it_was_given():
    def policy(td):
        raise ZeroDivisionError("boom")

    expected = r"the policy failed on a zero record .*'tag'.*: ZeroDivisionError: boom\.$"
    with pytest.raises(ValueError, match=expected) as info:
        AsyncPoolCollector(oracle_factories(2), policy=policy, frames_per_batch=8)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("envs_per_worker,env_threads", [("auto", "auto"), (2, True)])
def test_replay_buffer_iteration_yields_none_and_writes_everything(envs_per_worker, env_threads):
    checker = OracleChecker()
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=40, total_frames=200,
                           replay_buffer=rb, transition_chunk_size=5, envs_per_worker=envs_per_worker,
                           env_threads=env_threads)
    try:
        assert all(b is None for b in c)
        assert len(rb) == 200
        checker.observe_transitions(rb[:200])  # storage order = delivery order
    finally:
        c.shutdown()


@pytest.mark.parametrize("envs_per_worker,env_threads", [("auto", "auto"), (2, True)])
def test_start_fills_replay_buffer_in_background(envs_per_worker, env_threads):
    rb = ReplayBuffer(storage=LazyTensorStorage(2000))
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=32, total_frames=320,
                           replay_buffer=rb, transition_chunk_size=8, envs_per_worker=envs_per_worker,
                           env_threads=env_threads)
    start_and_check(c, rb, 320)


def test_background_collection_runs_torch_at_one_thread_beside_a_multithreaded_learner():
    """``start()``'s thread writes the replay buffer with one torch thread and the serving thread
    starts at ``policy_num_threads``, whatever the learner's count: a background thread that ever
    ran torch at the learner's count (2 on 2 cores) kept OpenMP from spinning for the learner's own
    threads, and a CPU learner's gradient step took ~2x longer while the collector was paused (see
    benchmarks/README.md, SAC)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = set()

    def policy(td):
        seen.add((threading.current_thread().name, torch.get_num_threads()))
        return oracle_policy(td)

    def hook(batch):
        seen.add((threading.current_thread().name, torch.get_num_threads()))

    rb = ReplayBuffer(storage=LazyTensorStorage(200))
    c = AsyncPoolCollector(oracle_factories(4), policy=policy, frames_per_batch=32, total_frames=128,
                           replay_buffer=rb, transition_chunk_size=8, post_collect_hook=hook)
    try:
        start_and_check(c, rb, 128)
        # (the start-up's timing of the policy runs in the constructing thread, at its count)
        background = seen - {("MainThread", 2)}
        assert background == {("torchrl_asyncpool-inference", 1), ("AsyncPoolCollector-replay", 1)}, seen
        assert torch.get_num_threads() == 2  # the learner's count is left as it was
    finally:
        torch.set_num_threads(before)


def test_return_same_td_writes_every_batch_into_one_tensordict():
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=50, total_frames=280,
                           transition_chunk_size=7, return_same_td=True)
    try:
        seen, pointers = [], []
        for i, batch in enumerate(c):
            checker.observe_transitions(batch)  # consumed before the next batch overwrites it
            seen.append(batch)
            pointers.append(batch["next", "observation"].data_ptr())
            if i == 1:  # an in-place postproc-like addition keeps the batch reusable
                batch.set("extra", torch.zeros(50))
            if i == 3:  # a tensor swapped for another: the next batch is a new TensorDict
                batch.set("observation", batch["observation"].clone())
        assert checker.records == 280
        assert [b.shape[0] for b in seen] == [50] * 5 + [30]
        assert seen[0] is seen[1] is seen[2] is seen[3] and len(set(pointers[:4])) == 1
        assert seen[4] is not seen[3] and seen[5] is not seen[4]  # after the swap; the short last batch
        assert "extra" in seen[3].keys()
    finally:
        c.shutdown()


def test_return_same_td_with_a_replay_buffer_stores_copies():
    checker = OracleChecker()
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=40, total_frames=200,
                           replay_buffer=rb, transition_chunk_size=5, return_same_td=True)
    try:
        assert all(b is None for b in c)
        checker.observe_transitions(rb[:200])  # five batches through one reused TensorDict, all distinct
        assert len(rb) == 200
    finally:
        c.shutdown()


def test_return_same_td_refuses_what_it_cannot_serve():
    from torchrl.data import ListStorage

    with pytest.raises(ValueError, match="yield_completed_trajectories"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, return_same_td=True,
                           yield_completed_trajectories=True)
    with pytest.raises(ValueError, match="ListStorage"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, return_same_td=True,
                           replay_buffer=ReplayBuffer(storage=ListStorage(10)))
    with pytest.raises(TypeError, match="must be a bool"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, return_same_td=1)


def test_state_dict_resumes_the_frame_count():
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=20, total_frames=100)
    try:
        it = iter(c)
        next(it), next(it)
        state = c.state_dict()
        assert state == {"frames": 40, "policy_version": 0}
    finally:
        c.shutdown()
    resumed = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=20, total_frames=100)
    try:
        resumed.load_state_dict({"frames": torch.tensor(40)})  # a checkpoint's tensor counts too
        resumed.load_state_dict({})  # TorchRL's empty state dict changes nothing
        assert [b.shape[0] for b in resumed] == [20, 20, 20]  # only what is left of total_frames
        assert resumed.state_dict()["frames"] == 100
        for bad in (-1, 2.5, True, "40"):
            with pytest.raises(ValueError, match="non-negative integer"):
                resumed.load_state_dict({"frames": bad})
    finally:
        resumed.shutdown()


def test_yield_completed_trajectories():
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(3), policy=oracle_policy, frames_per_batch=16, total_frames=60,
                           yield_completed_trajectories=True, transition_chunk_size=4)
    try:
        n = 0
        for traj in c:
            assert traj["next", "done"][-1].all() and not traj["next", "done"][:-1].any()
            assert traj["env_index"].unique().numel() == 1
            assert traj["tag"][0, 2] == 0  # starts an episode
            checker.observe_transitions(traj)  # each env's episodes arrive whole, in order, none skipped
            n += traj.shape[0]
        assert n >= 60
        assert checker.episodes_done >= 3 and checker.records == n
    finally:
        c.shutdown()


@pytest.mark.parametrize("trajectories", [False, True])
def test_rollout_is_the_callable_each_batch_comes_from(trajectories):
    """``collector.rollout`` (TorchRL's name): called by hand, before any iteration, it returns
    what iterating yields, the next ``frames_per_batch`` transitions, or the next whole
    trajectory, in the same exactly-once order the oracle checks (it hung before: the server
    waited for a first iteration to answer the envs)."""
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=16, total_frames=64,
                           yield_completed_trajectories=trajectories, transition_chunk_size=4)
    try:
        n = 0
        for _ in range(3):
            out = c.rollout()
            n += out.shape[0]
            if trajectories:
                assert out["next", "done"][-1].all() and not out["next", "done"][:-1].any()
                assert out["env_index"].unique().numel() == 1
            else:
                assert out.shape == (16,)
            checker.observe_transitions(out)
        assert checker.records == n and n >= 3 and (trajectories or n == 48)
    finally:
        c.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):  # not a wait for records that never come
        c.rollout()


def test_weight_update_bumps_stamped_version():
    policy = torch.nn.Linear(2, 1)

    def act(td):
        score = policy(td["observation"])
        return td.set("action", oracle_action(td["tag"])).set("score", score)

    c = AsyncPoolCollector(
        oracle_factories(2), policy=act, frames_per_batch=20, total_frames=200, transition_chunk_size=2
    )
    try:
        it = iter(c)
        first = next(it)
        assert first["policy_version"].eq(0).all()
        assert first["score"].shape == (20, 1)
        c.update_policy_weights_()
        assert c.policy_version == 1
        seen = set()
        for _ in range(5):
            seen |= set(next(it)["policy_version"].tolist())
        assert 1 in seen
    finally:
        c.shutdown()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="env_backend='asyncio' is not supported"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, env_backend="asyncio")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):  # Python's convention
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, no_such_option=1)
    with pytest.raises(ValueError, match="exactly one"):
        AsyncPoolCollector(oracle_factories(1), frames_per_batch=4)
    with pytest.raises(ValueError, match="action key"):
        AsyncPoolCollector(oracle_factories(1), policy=lambda td: td, frames_per_batch=4)
    with pytest.raises(ValueError, match="transport"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, transport="queue")
    with pytest.raises(ValueError, match="ProcessSlotTransport"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, transport=object())
    with pytest.raises(ValueError, match="num_threads must be None or a positive int, got 0"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, policy_num_threads=0)


def test_torchrl_docstring_example_float_actions_are_refused_or_cast_on_request():
    """TorchRL's first AsyncBatchedCollector example, with the class swapped. Its policy writes
    ``nn.Linear`` outputs as the one-hot action of CartPole (an int64 ``OneHot`` spec), which
    TorchRL truncates to integers without a word; here construction says so, and
    ``cast_actions=True`` (the documented opt-in) runs it as TorchRL does."""
    import torch.nn as nn
    from tensordict.nn import TensorDictModule
    from torchrl.envs import GymEnv

    policy = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
    kwargs = dict(create_env_fn=[lambda: GymEnv("CartPole-v1")] * 4, policy=policy, frames_per_batch=200,
                  total_frames=1000, env_backend="multiprocessing")
    with pytest.raises(ValueError, match=r"'action' is torch.float32 with fractional values .*OneHot.*cast_actions"):
        AsyncPoolCollector(**kwargs)
    collector = AsyncPoolCollector(**kwargs, cast_actions=True)
    for batch in collector:
        assert batch.shape == (200,)
        assert batch["action"].dtype == torch.int64
        break
    collector.shutdown()


class _ArgmaxIndex(torch.nn.Module):
    def forward(self, obs):  # push the cart the way the pole leans: an index, 0 or 1
        return (obs[..., 2] > 0).long()


def test_action_indices_for_gymenvs_onehot_actions_are_refused_at_construction_with_the_fix():
    """An argmax policy (action indices) on TorchRL's ``GymEnv("CartPole-v1")``, whose default
    encoding makes the action one-hot: construction names ``categorical_action_encoding=True``,
    and with it the same policy collects."""
    from tensordict.nn import TensorDictModule
    from torchrl.envs import GymEnv

    policy = TensorDictModule(_ArgmaxIndex(), in_keys=["observation"], out_keys=["action"])
    with pytest.raises(ValueError, match=r"one-hot rows of 2.*categorical_action_encoding=True"):
        AsyncPoolCollector([lambda: GymEnv("CartPole-v1")] * 2, policy=policy, frames_per_batch=64)
    collector = AsyncPoolCollector([lambda: GymEnv("CartPole-v1", categorical_action_encoding=True)] * 2,
                                   policy=policy, frames_per_batch=64, total_frames=64)
    batch = next(iter(collector))
    collector.shutdown()
    assert batch.shape == (64,) and set(batch["action"].tolist()) <= {0, 1}


def _make_linear_policy(device):
    """TorchRL's ``make_policy`` from its AsyncBatchedCollector examples (module level: picklable)."""
    import torch.nn as nn
    from tensordict.nn import TensorDictModule

    with torch.device(device):
        module = nn.Linear(4, 2)
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


_EXAMPLE_DEVICES = [
    pytest.param("cpu", 8, id="cpu-8envs"),
    pytest.param("cuda:0", 64, id="cuda-64envs", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.mark.parametrize("device,num_envs", _EXAMPLE_DEVICES)
def test_torchrl_second_docstring_example_runs_unchanged(device, num_envs):
    """TorchRL's process-server example (policy_factory, transport="auto", server/device configs).

    TorchRL writes it for ``cuda:0`` and 64 envs; without a GPU the same code runs on CPU with
    8 envs so CI still proves the keywords are accepted and honoured.
    """
    import functools

    from torchrl.envs import GymEnv
    from torchrl.modules.inference_server import InferenceDeviceConfig, InferenceServerConfig

    collector = AsyncPoolCollector(
        create_env_fn=[lambda: GymEnv("CartPole-v1")] * num_envs,
        policy_factory=functools.partial(_make_linear_policy, device),
        frames_per_batch=1024,
        env_backend="multiprocessing",
        transport="auto",
        transition_chunk_size=64,
        server_config=InferenceServerConfig(max_batch_size=num_envs, min_batch_size=1, timeout=0.001),
        device_config=InferenceDeviceConfig(policy_device=device, output_device="cpu", storing_device="cpu"),
        cast_actions=True,  # its nn.Linear writes float scores as CartPole's one-hot action (see the first example)
    )
    try:
        assert collector.server_backend == "process"
        learner_policy = _make_linear_policy(device)
        collector.update_policy_weights_(learner_policy)
        for batch in collector:
            assert batch.shape == torch.Size([1024])
            assert batch["env_index"].dtype == torch.long
            assert batch.device == torch.device("cpu")
            assert batch["policy_version"].eq(1).all()  # the weights given before iterating act from the start
            break
    finally:
        collector.shutdown()


@pytest.mark.parametrize("device,num_envs", _EXAMPLE_DEVICES)
def test_torchrl_third_docstring_example_hand_built_transport(device, num_envs):
    """TorchRL's example with a hand-built ProcessSlotTransport runs unchanged; a transport whose
    keys do not match the env/policy, or one given with policy=, raises a clear error."""
    import functools

    from torchrl.envs import GymEnv
    from torchrl.modules.inference_server import InferenceDeviceConfig, ProcessSlotTransport

    env = GymEnv("CartPole-v1")
    request_spec = env.fake_tensordict().select("observation")
    response_spec = _make_linear_policy("cpu")(request_spec.clone()).select("action")
    response_spec["policy_version"] = torch.zeros((), dtype=torch.long)
    env.close()
    collector = AsyncPoolCollector(
        create_env_fn=[lambda: GymEnv("CartPole-v1")] * num_envs,
        policy_factory=functools.partial(_make_linear_policy, device),
        frames_per_batch=1024,
        transport=ProcessSlotTransport(request_spec, response_spec, num_slots=num_envs),
        transition_chunk_size=64,
        device_config=InferenceDeviceConfig(policy_device=device, output_device="cpu", storing_device="cpu"),
        cast_actions=True,  # float scores as CartPole's one-hot action (see the first example)
    )
    try:  # it collects: a full batch of CartPole transitions, actions cast to the one-hot's dtype, versions
        batch = next(iter(collector))
        assert batch.batch_size == torch.Size([1024])
        assert batch["action"].shape == (1024, 2) and not batch["action"].is_floating_point()
        assert "policy_version" in batch.keys() and batch["next", "observation"].shape == (1024, 4)
    finally:
        collector.shutdown()

    factory = functools.partial(_make_linear_policy, "cpu")
    # without version stamping the transport's response spec carries no version either
    unstamped = AsyncPoolCollector(
        create_env_fn=[lambda: GymEnv("CartPole-v1")] * 2,
        policy_factory=factory,
        frames_per_batch=64,
        transport=ProcessSlotTransport(request_spec, response_spec.exclude("policy_version"), num_slots=2),
        policy_version_key=None,
        cast_actions=True,
    )
    try:
        batch = next(iter(unstamped))
        assert batch.batch_size == torch.Size([64]) and "policy_version" not in batch.keys()
    finally:
        unstamped.shutdown()

    bad_request = request_spec.clone()
    bad_request["pixels"] = torch.zeros(3, dtype=torch.uint8)
    refused = [  # (num envs, policy keywords, request spec, slots, what the error names)
        (2, {"policy_factory": factory}, bad_request, 2, "pixels"),
        (2, {"policy": _make_linear_policy("cpu")}, request_spec, 2, "policy_factory"),
        (4, {"policy_factory": factory}, request_spec, 2, "one slot per env"),
    ]
    for n, policy_kwargs, request, slots, match in refused:
        with pytest.raises(ValueError, match=match):
            AsyncPoolCollector(
                create_env_fn=[lambda: GymEnv("CartPole-v1")] * n,
                frames_per_batch=64,
                transport=ProcessSlotTransport(request, response_spec, num_slots=slots),
                **policy_kwargs,
            )


def test_process_server_with_policy_factory_and_weight_update():
    """policy_factory= serves from a dedicated process; weights travel without a restart."""
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    c = AsyncPoolCollector(oracle_factories(4), policy_factory=OracleTagPolicy, frames_per_batch=16,
                           total_frames=400, envs_per_worker=2, transition_chunk_size=4)
    try:
        assert c.server_backend == "process"
        checker = OracleChecker()
        it = iter(c)
        checker.observe_transitions(next(it))
        c.update_policy_weights_(OracleTagPolicy(offset=0))
        seen = set()
        for batch in it:
            checker.observe_transitions(batch)
            seen |= set(batch["policy_version"].tolist())
        assert 1 in seen and checker.records == 400
    finally:
        c.shutdown()


def test_acting_policy_pause_gate():
    """pause() waits for the running call (or times out, pausing nothing), holds new calls until
    resume(); a second pause or a resume of a running policy does nothing."""
    from torchrl_asyncpool.collector.acting_policy import ActingPolicy

    inside, release = threading.Event(), threading.Event()

    def slow(td):
        inside.set()
        release.wait(10)
        return td.set("action", torch.zeros(td.shape[0], dtype=torch.int64))

    ap = ActingPolicy(slow)
    td = TensorDict({}, [2])
    t = threading.Thread(target=ap, args=(td,))
    t.start()
    assert inside.wait(10)
    with pytest.raises(TimeoutError):
        ap.pause(timeout=0.05)  # the call is still running
    release.set()
    t.join(10)
    ap.pause(timeout=5)
    ap.pause(timeout=5)  # already paused: returns at once
    done = []
    t = threading.Thread(target=lambda: done.append(ap(td.clone())))
    t.start()
    time.sleep(0.1)
    assert not done  # held by the gate
    threading.Thread(target=ap.resume).start()  # shutdown resumes from another thread
    t.join(10)
    assert len(done) == 1 and (done[0]["action"] == 0).all()
    ap.resume()  # not paused: nothing happens
    assert ap(td.clone())["action"].shape == (2,)


def test_pause_keeps_the_policy_idle():
    calls = {"n": 0}

    def counting(td):
        calls["n"] += 1
        return oracle_policy(td)

    c = AsyncPoolCollector(oracle_factories(2), policy=counting, frames_per_batch=8, transition_chunk_size=2)
    try:
        it = iter(c)
        next(it)
        with c.pause():
            n = calls["n"]
            time.sleep(0.3)
            assert calls["n"] == n
        next(it)
        assert calls["n"] > n
    finally:
        c.shutdown()


def _in_thread(fn, timeout):
    """``fn()``'s result or exception, or ``"hung"`` past ``timeout`` seconds."""
    out = {"r": "hung"}

    def run():
        try:
            out["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["r"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return out["r"]


def test_a_batch_asked_for_inside_pause_by_its_thread_is_refused_another_thread_waits():
    """Inside ``with collector.pause():`` nothing steps: the pausing thread's own ``next()`` (or
    ``rollout()``) would wait forever (it hung before), so it raises; another thread's ``next()``
    waits and gets its batch once the block ends."""
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=8, transition_chunk_size=2)
    try:
        it = iter(c)
        next(it)
        with c.pause():
            with pytest.raises(RuntimeError, match="by the thread that paused"):
                c.rollout()
        got = []
        with c.pause():
            waiter = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
            waiter.start()
            time.sleep(0.5)
            assert not got  # waits while paused
        waiter.join(20)
        assert len(got) == 1 and got[0].shape == (8,)

        def next_inside_pause():
            with c.pause():
                return next(it)

        err = _in_thread(next_inside_pause, 20)
        assert isinstance(err, RuntimeError) and "inside `with collector.pause():`" in str(err), err
        with pytest.raises(RuntimeError, match="shut down"):  # an error out of iteration ends it, as in TorchRL
            next(iter(c))
    finally:
        c.shutdown()


def test_log_metrics_writes_pool_and_server_scalars_to_a_torchrl_logger(tmp_path):
    from torchrl.record.loggers.csv import CSVLogger

    logger = CSVLogger(exp_name="run", log_dir=str(tmp_path))
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=20, total_frames=40)
    try:
        for _ in c:
            pass
        logged = c.log_metrics(logger, step=40)
        assert logged["collector/pool/frames"] >= 40 and logged["collector/server/frames"] >= 40
        assert "collector/server/per_key/policy/batches" in logged  # nested stats, flattened
        assert not any(k.endswith("/mode") for k in logged)  # not a number: left out
        pool_logged = c.env.log_metrics(logger, step=40, reset=True)
        assert set(pool_logged) == {f"pool/{k}" for k in c.pool_metrics()}
        with pytest.raises(TypeError, match="log_scalar"):
            c.log_metrics(object())
        with pytest.raises(TypeError, match="prefix must be a str"):
            c.log_metrics(logger, prefix=None)
    finally:
        c.shutdown()
    scalars = tmp_path / "run" / "scalars"
    rows = (scalars / "collector" / "pool" / "frames.csv").read_text().strip().splitlines()
    assert len(rows) == 1 and rows[0].split(",")[0] == "40"
    assert (scalars / "pool" / "env_step_time_s.csv").exists()


# -- TorchRL's collector surface: len(), stats(), the batch layout ---------------------------------
def test_len_list_and_stats_as_torchrl_collectors_have_them():
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=20, total_frames=50)
    try:
        assert len(c) == 3  # BaseCollector.__len__: ceil(total_frames / requested_frames_per_batch)
        assert [b.shape[0] for b in list(c)] == [20, 20, 10]  # list() asks len() first
        stats = c.stats()
        assert stats["requested_frames_per_batch"] == 20 and stats["frames"] == 50 and stats["completed"]
    finally:
        c.shutdown()


def test_batches_have_torchrl_collector_keys_including_root_done_flags():
    """Same env and policy through TorchRL's AsyncBatchedCollector and this one (without the
    ("collector", "traj_ids") it writes by default, see test_traj_ids.py): the same keys, shapes
    and dtypes; the root done flags (those of the record the action answered) are False."""
    import warnings

    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    layouts = []
    for cls, kwargs in ((AsyncBatchedCollector, {"env_backend": "threading"}),
                        (AsyncPoolCollector, {"track_traj_ids": False})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            c = cls(oracle_factories(2), policy=OracleTagPolicy(), frames_per_batch=20, total_frames=40, **kwargs)
        try:
            batch = next(iter(c))
        finally:
            c.shutdown()
        batch = batch.to_tensordict() if hasattr(batch, "to_tensordict") else batch
        layouts.append({k: (tuple(batch.get(k).shape), batch.get(k).dtype) for k in batch.keys(True, True)})
        for key in ("done", "terminated", "truncated"):
            assert not batch[key].any()
    assert layouts[0] == layouts[1]


# -- TorchRL's recurrent setup (LSTMModule + make_tensordict_primer + InitTracker) ------------------
def _lstm():
    from torchrl.modules import LSTMModule

    return LSTMModule(input_size=2, hidden_size=4, in_key="observation", out_key="feat")


def _recurrent_env(env_id):
    from torchrl.envs import Compose, InitTracker, TransformedEnv
    from torchrl_asyncpool.testing import OracleEnv

    return TransformedEnv(OracleEnv(env_id=env_id), Compose(InitTracker(), _lstm().make_tensordict_primer()))


def _recurrent_policy():
    from tensordict.nn import TensorDictModule, TensorDictSequential

    torch.manual_seed(0)
    return TensorDictSequential(_lstm(), TensorDictModule(_OracleModule(), in_keys=["tag"], out_keys=["action"]))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_torchrl_recurrent_policy_carries_its_hidden_state_from_step_to_step(mode):
    """The policy's ("next", hidden) is the next step's root hidden input (zeros when an episode
    starts), as with TorchRL's collectors; the delivered root state is the one the policy read."""
    import functools

    kwargs = {"policy": _recurrent_policy()} if mode == "thread" else {"policy_factory": _recurrent_policy}
    c = AsyncPoolCollector([functools.partial(_recurrent_env, i) for i in range(3)], frames_per_batch=30,
                           total_frames=90, **kwargs)
    try:
        td = torch.cat(list(c))
    finally:
        c.shutdown()
    OracleChecker().observe_transitions(td)
    first = td["tag"][:, 2] == 0
    assert td["is_init"].squeeze(-1).equal(first)
    for key in ("recurrent_state_h", "recurrent_state_c"):
        assert td[key][first].eq(0).all()
        assert td[key][~first].flatten(1).abs().sum(-1).gt(0).all()
        for e in range(3):
            rows = td[td["env_index"] == e]
            later = (rows["tag"][1:, 2] != 0).nonzero().squeeze(-1) + 1
            assert later.numel() > 5
            assert torch.equal(rows[key][later], rows["next", key][later - 1])
    replay = _recurrent_policy()(
        td.select("observation", "recurrent_state_h", "recurrent_state_c", "is_init", "tag").clone()
    )
    for key in ("feat", ("next", "recurrent_state_h"), ("next", "recurrent_state_c")):
        assert torch.allclose(replay[key], td[key], atol=1e-6), key
    assert not any("_carried_state" in str(k) for k in td.keys(True, True))


def test_policy_layout_is_computed_before_the_pool_and_handed_to_it_as_values(monkeypatch):
    """The policy's outputs and TorchRL recurrent keys are known before the pool is built, and
    the pool gets them as plain mappings (no callback filling a dict the pool reads later)."""
    import functools

    from torchrl_asyncpool.collector.acting_policy import CARRY_KEY, ActingPolicy
    from torchrl_asyncpool.collector.policy_layout import PolicyLayout
    from torchrl_asyncpool.pool.plan import PoolPlan

    factories = [functools.partial(_recurrent_env, i) for i in range(2)]
    layout = PolicyLayout.probe(ActingPolicy(_recurrent_policy()), factories)
    expected = {(CARRY_KEY, k): ("next", k) for k in ("recurrent_state_h", "recurrent_state_c")}
    assert layout.recurrent == expected
    assert layout.recurrent_keys == {(k,): (CARRY_KEY, k) for k in ("recurrent_state_h", "recurrent_state_c")}
    assert {("next", "recurrent_state_h"), "feat", "policy_version"} <= set(layout.outputs)

    given = {}
    build = PoolPlan.build.__func__

    def spy(cls, *args, **kwargs):
        # copies, as they are when the pool's plan is built (a dict filled later would not count)
        given.update(outputs=kwargs["policy_output_spec"], recurrent=dict(kwargs["recurrent_state"]))
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(PoolPlan, "build", classmethod(spy))
    c = AsyncPoolCollector(factories, policy=_recurrent_policy(), frames_per_batch=10, total_frames=10,
                           env_backend="threading")
    try:
        assert not callable(given["outputs"]) and given["outputs"] == dict(layout.outputs)
        assert given["recurrent"] == expected
        assert c.recurrent_keys == layout.recurrent_keys and c.env.recurrent_state == expected
    finally:
        c.shutdown()


def test_collector_config_translates_torchrl_keywords_into_a_frozen_config():
    import dataclasses

    from torchrl.modules.inference_server import InferenceServerConfig

    from torchrl_asyncpool.collector.config import CollectorConfig

    config = CollectorConfig.from_arguments(
        oracle_factories(2), policy=None, policy_factory=lambda: oracle_policy, frames_per_batch=8, total_frames=-1,
        max_batch_size=None, min_batch_size=None, server_timeout=None, device=None, device_config=None,
        server_config=InferenceServerConfig(max_batch_size=4, static_batch_size=8, timeout=0.0),
        worker_affinity=None, driver_affinity=None, replay_buffer=None, torchrl_kwargs={"backend": "threading"},
    )
    assert config.env_backend == "threading" and config.server_backend == "thread"  # backend= sets both
    assert (config.max_batch_size, config.bucket_sizes, config.server_timeout) == (4, (8,), 0.0)
    assert config.policy_device == torch.device("cpu") and config.storing_device is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.frames_per_batch = 16


class _PredictNextObservation(torch.nn.Module):
    def forward(self, tag):
        return oracle_action(tag), torch.full((tag.shape[0], 2), -7.0)


def test_a_next_entry_for_an_env_produced_observation_is_not_carried():
    """Only primer entries are carried: a policy writing ("next", "observation") does not replace
    what the env observes (TorchRL's env step output wins there too)."""
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(_PredictNextObservation(), in_keys=["tag"], out_keys=["action", ("next", "observation")])
    c = AsyncPoolCollector(oracle_factories(2), policy=policy, frames_per_batch=20, total_frames=40)
    try:
        td = torch.cat(list(c))
    finally:
        c.shutdown()
    OracleChecker().observe_transitions(td)
    env_ids = td["env_index"].float()[:, None].expand(-1, 2)
    assert torch.equal(td["observation"], env_ids) and torch.equal(td["next", "observation"], env_ids)


# -- weights and lifecycle --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_weights_given_before_the_first_iteration_act_from_the_first_transition(mode):
    """TorchRL applies such weights before any request is served: the envs are built and reset at
    construction, but no action is served before the first iteration."""
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    kwargs = {"policy": OracleTagPolicy()} if mode == "thread" else {"policy_factory": OracleTagPolicy}
    c = AsyncPoolCollector(oracle_factories(4), frames_per_batch=32, total_frames=96, **kwargs)
    try:
        time.sleep(0.5)  # the learner is being built; the envs wait
        assert c.server_stats()["frames"] == 0
        c.update_policy_weights_(OracleTagPolicy(offset=5))
        td = torch.cat(list(c))
    finally:
        c.shutdown()
    assert td["policy_version"].eq(1).all()
    assert torch.equal(td["action"], (oracle_action(td["tag"]) + 5) % 1000)


def test_after_a_weight_update_about_one_batch_at_most_was_collected_by_the_old_policy():
    """transition_chunk_size="auto": the chunks all envs may fill ahead hold about one batch."""
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    c = AsyncPoolCollector(oracle_factories(4), policy=OracleTagPolicy(), frames_per_batch=64)
    try:
        assert c.env._chunks.chunk_size == 8  # 64 // (4 envs * 2 chunks each)
        it = iter(c)
        next(it)
        time.sleep(0.5)  # a slow learner: every env fills all the chunks it may
        c.update_policy_weights_(OracleTagPolicy(offset=1))
        stale = [int(next(it)["policy_version"].eq(0).sum()) for _ in range(4)]
    finally:
        c.shutdown()
    # 4 envs x 2 chunks x 8, plus the one action per env answered before the update
    assert sum(stale) <= 64 + 4 and stale[-1] == 0, stale


def test_auto_chunk_size_bounds_the_lag_and_the_memory():
    from torchrl_asyncpool.collector.collector import _auto_chunk
    from torchrl_asyncpool.exchange.arena import ArenaLayout

    def layout(n, obs_shape):
        flags = {k: ((1,), torch.bool) for k in ("done", "terminated", "truncated")}
        request = {"observation": (obs_shape, torch.uint8), "reward": ((1,), torch.float32),
                   "step_type": ((), torch.int8), **flags}
        return ArenaLayout(n, request, {"action": ((), torch.int64)})

    assert _auto_chunk("auto", layout(32, (4,)), 1024, 2) == 16
    assert _auto_chunk("auto", layout(4, (4,)), 64, 1) == 16
    assert _auto_chunk("auto", layout(64, (4,)), 64, 2) == 1  # never 0
    # 84x84x3 pixels, root and next: 42362 bytes a transition, 2 envs x 2 chunks within 256 MiB
    assert _auto_chunk("auto", layout(2, (84, 84, 3)), 100_000, 2) == 1584
    assert _auto_chunk(7, layout(2, (4,)), 64, 2) == 7


def test_calls_after_shutdown_raise_as_iteration_does():
    c = AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4)
    c.shutdown()
    for call in (lambda: next(iter(c)), c.update_policy_weights_, lambda: c.pause().__enter__()):
        with pytest.raises(RuntimeError, match="AsyncPoolCollector was shut down"):
            call()
    assert c.policy_version == 0  # nothing was bumped


def test_weights_for_a_plain_function_policy_point_to_the_call_without_argument():
    net = torch.nn.Linear(2, 1)

    def act(td):
        td.set("score", net(td["observation"]))
        return oracle_policy(td)

    c = AsyncPoolCollector(oracle_factories(1), policy=act, frames_per_batch=4)
    try:
        with pytest.raises(ValueError, match=r"plain callable.*update_policy_weights_\(\) with no argument"):
            c.update_policy_weights_(net)
        c.update_policy_weights_()
        assert c.policy_version == 1
    finally:
        c.shutdown()


# -- arguments: refused before anything starts, or honoured ----------------------------------------
def _no_env():
    raise AssertionError("an env was built before the arguments were checked")


def test_bad_arguments_are_refused_before_any_env_is_built():
    from torchrl.modules.inference_server import InferenceDeviceConfig, InferenceServerConfig

    envs = [_no_env] * 2
    refused = [  # (keywords, error, what the message names)
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be None or a positive int"),
        ({"min_batch_size": 3, "max_batch_size": 2}, ValueError, "min_batch_size=3 must not exceed max_batch_size=2"),
        ({"server_timeout": -1}, ValueError, "server_timeout"),
        ({"frames_per_batch": 64.0}, ValueError, "frames_per_batch"),
        ({"frames_per_batch": True}, ValueError, "frames_per_batch"),
        ({"policy": 42}, TypeError, "policy must be callable"),
        ({"policy": None, "policy_factory": 42}, TypeError, "policy_factory must be callable"),
        ({"server_config": InferenceServerConfig(service_backend="process")}, TypeError, "requires policy_factory"),
        ({"server_config": InferenceServerConfig(service_backend="ray")}, ValueError, "service_backend='ray'"),
        ({"server_config": InferenceServerConfig(collect_stats=False)}, ValueError, "collect_stats"),
        ({"server_config": InferenceServerConfig(stats_window_size=10)}, ValueError, "stats_window_size"),
        ({"device_config": InferenceDeviceConfig(output_device="meta")}, ValueError, "output_device"),
        ({"device_config": InferenceDeviceConfig(env_device="meta")}, ValueError, "env_device"),
    ]
    if not torch.cuda.is_available():
        refused += [
            ({"device": "cuda:0"}, ValueError, "device='cuda:0', but CUDA is not available"),
            ({"device_config": InferenceDeviceConfig(storing_device="cuda")}, ValueError, "CUDA is not available"),
        ]
    for kwargs, error, match in refused:
        kwargs = {"policy": oracle_policy, "frames_per_batch": 8, **kwargs}
        with pytest.raises(error, match=match):
            AsyncPoolCollector(envs, **kwargs)
    with pytest.raises(TypeError, match=r"list of env factories.*\[make_env\] \* n.*got function"):
        AsyncPoolCollector(_no_env, policy=oracle_policy, frames_per_batch=8)


def test_numpy_integers_and_server_config_fields_are_honoured():
    import numpy as np
    from torchrl.modules.inference_server import InferenceServerConfig

    config = InferenceServerConfig(max_batch_size=4, static_batch_size=8, timeout=0.0, max_inflight_per_env=1)
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=np.int64(10),
                           total_frames=np.int32(30), server_config=config)
    try:
        assert type(c.frames_per_batch) is int and c.total_frames == 30
        assert c.server.bucket_sizes == {"policy": (8,)} and c.server.max_get == 4
        assert [b.shape[0] for b in c] == [10, 10, 10]
        assert c.server_stats()["padding_fraction"] > 0.5  # batches of at most 2 envs, run as 8 rows
    finally:
        c.shutdown()


@pytest.mark.parametrize("idle_poll", [True, False])
def test_idle_poll_reaches_the_workers_and_the_policy_server_process(idle_poll):
    """The collector's ``idle_poll`` is its pool's, and the serving loop follows the pool: each
    process that idle-polls runs the C extension's poller thread, named ``asyncpool-idle``."""
    from torchrl_asyncpool.exchange import doorbell
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    if doorbell._c is None:
        pytest.skip("idle polling is in the C extension")

    c = AsyncPoolCollector(oracle_factories(4), policy_factory=OracleTagPolicy, frames_per_batch=40,
                           total_frames=400, envs_per_worker=2, idle_poll=idle_poll)
    try:
        checker = OracleChecker()
        for batch in c:
            checker.observe_transitions(batch)
            procs = {"server": c.server.pid, **{f"worker {w}": p for w, p in enumerate(c.env.worker_pids)}}
        assert checker.records == 400 and c.env.idle_poll is idle_poll
        for name, pid in procs.items():
            assert ("asyncpool-idle" in thread_names(pid)) is idle_poll, (name, thread_names(pid))
    finally:
        c.shutdown()


class _Linear2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, obs):
        return self.lin(obs).argmax(-1)


def test_weights_that_do_not_match_are_refused_naming_the_names_and_a_prefix_that_differs():
    """``update_policy_weights_`` with another module's names: ``KeyError`` listing the unknown
    and missing ones, and when they differ by one segment (the inner module's state dict for a
    TensorDictModule, or a wrapper's), which; a shape: ``ValueError``. Nothing is applied."""
    import gymnasium as gym
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(_Linear2(), in_keys=["observation"], out_keys=["action"])
    c = AsyncPoolCollector([lambda: gym.make("CartPole-v1")] * 2, policy=policy, frames_per_batch=32, total_frames=-1)
    try:
        it = iter(c)
        next(it)
        version = c.state_dict()["policy_version"]
        with pytest.raises(KeyError, match=r"unknown \['policy.lin.bias', .*'module.'\): pass the served module"):
            c.update_policy_weights_(_Linear2().state_dict())
        wrapped = {"wrapper." + k: v for k, v in policy.state_dict().items()}
        with pytest.raises(KeyError, match=r"state dict of a wrapper .*'wrapper.'"):
            c.update_policy_weights_(wrapped)
        with pytest.raises(KeyError, match=r"unknown \['policy.foo'\], missing") as info:
            c.update_policy_weights_({"foo": torch.zeros(3)})
        assert "look like" not in str(info.value)
        with pytest.raises(ValueError, match=r"'policy.module.lin.weight' has shape \(7,\), expected \(2, 4\)"):
            c.update_policy_weights_({k: torch.zeros(7) for k in policy.state_dict()})
        assert c.state_dict()["policy_version"] == version  # none of them was applied
        assert next(it).shape == (32,)
    finally:
        c.shutdown()
