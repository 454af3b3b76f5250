"""Unit tests of the exchange building blocks and the step type."""
import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from torchrl_asyncpool import StepType, discount_from_step_type
from torchrl_asyncpool.exchange import Arena, ArenaLayout, BellWait, Doorbell, poll_for
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool.exchange import doorbell as doorbell_module
from torchrl_asyncpool._sys.forkserver import forkserver_context


def _child_writes(layout, fd, bell):
    arena = Arena.attach(layout, fd.fd)
    arena.request["obs"][2] = 42.0
    arena.state[2] = 1
    Doorbell(bell.fd).ring()


def test_arena_is_shared_with_a_forkserver_child_and_has_no_dev_shm_file(dev_shm_guard):
    layout = ArenaLayout(4, {"obs": ((3,), torch.float32)}, {("a", "b"): ((2,), torch.int64)})
    arena = Arena.create(layout)
    bell = Doorbell()
    # started as the pool starts it: a fork server started without torch in its preload would
    # make every later pool's workers import torch themselves (see torchrl_asyncpool._sys.forkserver)
    ctx = forkserver_context()
    p = ctx.Process(target=_child_writes, args=(layout, InheritedFd(arena.fd), bell.inheritable()))
    p.start()
    assert bell.wait(timeout=30)
    p.join(10)
    assert p.exitcode == 0
    assert arena.request["obs"][2].tolist() == [42.0] * 3
    assert arena.state.tolist() == [0, 0, 1, 0]
    assert arena.response["a", "b"].shape == (4, 2)
    arena.close()
    bell.close()


def test_doorbell_counts_and_times_out():
    bell = Doorbell()
    assert bell.drain() == 0
    assert not bell.wait(timeout=0.01)
    bell.ring(3)
    assert bell.wait(timeout=0)
    assert bell.drain() == 3
    bell.close()


def test_poll_for_honours_sub_millisecond_timeouts():
    # poll(2) counts whole milliseconds and CPython rounds up: a 200 us wait used to take >= 1 ms
    # every time (a 100 us flush deadline idled the envs a full millisecond). A low percentile of
    # many tries keeps descheduled tries on a busy machine from failing the test: the rounding
    # made every try last a millisecond or more.
    bell = Doorbell()
    p = select.poll()
    p.register(bell.fd, select.POLLIN)
    took = []
    for _ in range(31):
        t0 = time.monotonic()
        assert poll_for(p, 0.0002) == []
        took.append(time.monotonic() - t0)
    assert sorted(took)[3] < 0.00095, took  # the 10th percentile of 31
    bell.ring()
    assert [fd for fd, _ in poll_for(p, 0.0002)] == [bell.fd]
    assert [fd for fd, _ in poll_for(p, 5.0)] == [bell.fd]  # ready: returns at once
    bell.drain()
    t0 = time.monotonic()
    assert poll_for(p, 0.0) == []
    assert not bell.wait(timeout=0.0015)
    assert time.monotonic() - t0 >= 0.0015  # waits of a millisecond or more still wait in full
    bell.close()


@pytest.fixture(params=["native", "native-idle-poll", "python"])
def bell_impl(request, monkeypatch):
    """The doorbell calls through the C extension (its blocking waits plain, then idle-polled),
    then through os and select."""
    if request.param.startswith("native"):
        if doorbell_module._c is None:
            pytest.skip("the C extension is not built")
        was = doorbell_module._c.set_idle_poll(request.param == "native-idle-poll")
        yield request.param
        doorbell_module._c.set_idle_poll(was)
    else:
        monkeypatch.setattr(doorbell_module, "_c", None)
        yield request.param


def test_bell_wait_drains_its_bell_and_reports_other_descriptors(bell_impl):
    bell = Doorbell()
    r, w = os.pipe()
    waiter = BellWait(bell, [r])
    try:
        assert waiter.wait(0.0) == [] and waiter.wait(0.002) == []
        bell.ring(2)
        assert waiter.wait(0.0) == [bell.fd]  # a zero timeout still drains
        assert bell.drain() == 0
        bell.ring()
        assert waiter.wait(None) == [bell.fd] and bell.drain() == 0
        os.write(w, b"x")
        bell.ring()
        assert waiter.wait(5.0) == [bell.fd, r]  # in the order given, the bell drained
        assert bell.drain() == 0 and waiter.wait(0.0) == [r]  # the pipe stays readable: not ours to read
        os.read(r, 1)
        os.close(w)
        w = -1
        assert waiter.wait(5.0) == [r]  # a hang-up ends the wait too
        assert BellWait(None, [r]).wait(0.0) == [r]
    finally:
        bell.close()
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_wait_loop_sleeps_through_rings_until_deaf_until_but_not_through_a_stop(bell_impl):
    from torchrl_asyncpool.exchange.wait_loop import NOT_DUE, READY, STOPPED, WaitLoop

    bell = Doorbell()
    r, w = os.pipe()
    published = []
    loop = WaitLoop(bell, [r], stop_fds=[r])

    def due(now):
        return 0.0 if published else NOT_DUE

    def publish_and_ring(delay):
        time.sleep(delay)
        published.append(1)
        bell.ring()

    try:
        # deaf for 0.3 s: a publication rung after 20 ms is found when the deaf period ends
        loop.deaf_until = time.monotonic() + 0.3
        t = threading.Thread(target=publish_and_ring, args=(0.02,))
        t0 = time.monotonic()
        t.start()
        assert loop.run(due) == READY
        assert time.monotonic() - t0 >= 0.29
        t.join()
        # listening again (the deaf period is over): the ring ends the wait
        published.clear()
        t = threading.Thread(target=publish_and_ring, args=(0.02,))
        t.start()
        assert loop.run(due, deadline=time.monotonic() + 30) == READY
        t.join()
        # a stop descriptor is listened to while deaf
        published.clear()
        loop.deaf_until = time.monotonic() + 30
        threading.Timer(0.02, os.write, args=(w, b"x")).start()
        t0 = time.monotonic()
        assert loop.run(due) == STOPPED
        assert time.monotonic() - t0 < 20
    finally:
        bell.close()
        os.close(r)
        os.close(w)


def test_doorbell_counts_any_integer_and_refuses_the_rest(bell_impl):
    import numpy as np

    bell = Doorbell()
    try:
        bell.ring(np.int64(3))  # a count computed with numpy, as os.eventfd_write takes it
        bell.ring()
        assert bell.drain() == 4 and bell.drain() == 0
        for bad, error in ((-1, (OverflowError, ValueError)), (1.5, TypeError), ("1", TypeError)):
            with pytest.raises(error):
                bell.ring(bad)
        assert bell.drain() == 0
    finally:
        bell.close()


def test_bell_wait_lets_other_threads_run_and_honours_short_timeouts(bell_impl):
    bell = Doorbell()
    waiter = BellWait(bell)
    # the ring comes from another Python thread: a wait that kept the GIL would never return
    ringer = threading.Timer(0.05, bell.ring)
    ringer.start()
    t0 = time.monotonic()
    assert waiter.wait(30.0) == [bell.fd]
    assert time.monotonic() - t0 < 20.0
    ringer.join()
    took = []
    for _ in range(31):
        t0 = time.monotonic()
        assert waiter.wait(0.0002) == []
        took.append(time.monotonic() - t0)
    assert sorted(took)[3] < 0.00095, took  # 10th percentile: not poll(2)'s rounded-up millisecond
    t0 = time.monotonic()
    assert waiter.wait(0.0015) == []
    assert time.monotonic() - t0 >= 0.001
    bell.close()


class _Interrupted(Exception):
    pass


@contextlib.contextmanager
def _alarms_raise():
    """SIGALRM raises :class:`_Interrupted` in the block; the timer and the handler are reset after."""
    def handler(signum, frame):
        raise _Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_bell_wait_is_interrupted_by_a_signal_handler_that_raises(bell_impl):
    bell = Doorbell()
    try:
        with _alarms_raise():
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            t0 = time.monotonic()
            with pytest.raises(_Interrupted):
                BellWait(bell).wait(30.0)
            assert time.monotonic() - t0 < 20.0
    finally:
        bell.close()


def test_an_idle_polled_wait_runs_signal_handlers_that_arrive_between_its_self_checks():
    # a parked main thread wakes up every millisecond to check its descriptors; a signal that
    # lands outside the futex wait interrupts nothing, so the wait must go back to Python to
    # run the handler (a CI run waited the full 30 s once before it did). The alarms also land
    # around the 5 ms patience, after which the wait blocks in poll(2): a signal just before that
    # poll interrupts nothing either, so the main thread's blocking rest is cut into 50 ms polls
    # (another CI run waited 30 s there)
    if doorbell_module._c is None:
        pytest.skip("the C extension is not built")
    bell = Doorbell()
    waiter = BellWait(bell, idle_poll=True)
    try:
        with _alarms_raise():
            for i in range(120):
                t0 = time.monotonic()
                with pytest.raises(_Interrupted):  # across the 1 ms self-checks and the 5 ms patience
                    signal.setitimer(signal.ITIMER_REAL, 0.001 + 0.00005 * (i % 113))
                    waiter.wait(30.0)
                assert time.monotonic() - t0 < 10.0
            for delay in (0.03, 0.2):  # well into the blocking rest
                t0 = time.monotonic()
                with pytest.raises(_Interrupted):
                    signal.setitimer(signal.ITIMER_REAL, delay)
                    waiter.wait(30.0)
                assert time.monotonic() - t0 < delay + 5.0
    finally:
        bell.close()


def test_idle_polled_waits_ping_pong_with_a_forked_child_and_many_threads():
    # the child inherits the parent's poller records but not its thread: its first wait must
    # start a poller of its own; more waiting threads than the poller has records fall back to
    # a plain poll. A lost wake-up would show as a wait that runs into its 30 s limit.
    if doorbell_module._c is None:
        pytest.skip("the C extension is not built")
    was = doorbell_module._c.set_idle_poll(False, 200)  # the waits below say idle_poll=True
    ping, pong = Doorbell(), Doorbell()
    try:
        assert BellWait(ping, idle_poll=True).wait(0.001) == []  # the parent's poller runs
        pid = os.fork()
        if pid == 0:  # the child: answers 200 pings, each after a blocking idle-polled wait
            code = 1
            try:
                waiter = BellWait(ping, idle_poll=True)
                for _ in range(200):
                    if waiter.wait(30.0) != [ping.fd]:
                        break
                    pong.ring()
                else:
                    code = 0
            finally:
                os._exit(code)
        waiter = BellWait(pong, idle_poll=True)
        t0 = time.monotonic()
        for _ in range(200):
            ping.ring()
            assert waiter.wait(30.0) == [pong.fd]
        assert os.waitpid(pid, 0)[1] == 0
        assert time.monotonic() - t0 < 60.0
        bells = [Doorbell() for _ in range(80)]  # the poller has 64 records
        got = []
        def wait_for(b):
            got.append(BellWait(b, idle_poll=True).wait(30.0) == [b.fd])

        threads = [threading.Thread(target=wait_for, args=(b,)) for b in bells]
        for t in threads:
            t.start()
        time.sleep(0.05)
        for b in bells:
            b.ring()
        for t in threads:
            t.join(60.0)
        assert got == [True] * len(bells)
        for b in bells:
            b.close()
        with pytest.raises(TypeError, match="idle_poll must be True, False or None"):
            BellWait(ping, idle_poll=1)
    finally:
        doorbell_module._c.set_idle_poll(was, 1000)  # and the default 1 ms self-check
        ping.close()
        pong.close()


@pytest.mark.skipif(doorbell_module._c is None, reason="idle polling is in the C extension")
@pytest.mark.parametrize("in_thread", [False, True])
def test_a_long_idle_polled_wait_leaves_the_cpu_idle(in_thread):
    """Only a wait's first milliseconds idle-poll; the rest blocks, so the poller parks and a
    pool nobody drives costs no CPU (before: the poller spun for the whole wait)."""
    bell = Doorbell()
    try:
        waiter = BellWait(bell, idle_poll=True)
        assert waiter.wait(0.01) == []  # the poller is running
        out = {}

        def wait():
            t0, c0 = time.monotonic(), time.process_time()  # every thread of the process, the poller's too
            out["fired"] = waiter.wait(1.0)
            out["wall"], out["cpu"] = time.monotonic() - t0, time.process_time() - c0

        if in_thread:
            t = threading.Thread(target=wait)
            t.start()
            t.join(30)
        else:
            wait()
        assert out["fired"] == [] and out["wall"] >= 0.99
        assert out["cpu"] < 0.3, f"an idle-polled 1 s wait burned {out['cpu']:.2f}s CPU"
        # and a ring during the blocking part still ends the wait at once
        threading.Timer(0.2, bell.ring).start()
        t0 = time.monotonic()
        assert waiter.wait(10.0) == [bell.fd] and time.monotonic() - t0 < 5.0
    finally:
        bell.close()


@pytest.mark.skipif(doorbell_module._c is None, reason="the wake-up probe is in the C extension")
def test_wake_probe_measures_a_cross_core_round_trip_and_restores_the_callers_cpu_mask():
    mask = os.sched_getaffinity(0)
    cost = doorbell_module._c.wake_probe(16, 100)
    assert os.sched_getaffinity(0) == mask
    if len(mask) < 2:
        assert cost is None
    else:  # two wake-ups of a blocked thread: more than nothing, far less than the 2 s poll limit
        assert isinstance(cost, int) and 0 < cost < 1_000_000_000
    os.sched_setaffinity(0, {min(mask)})
    try:
        assert doorbell_module._c.wake_probe(4, 0) is None  # one CPU: nothing to wake across cores
    finally:
        os.sched_setaffinity(0, mask)
    with pytest.raises(ValueError, match="rounds"):
        doorbell_module._c.wake_probe(0, 100)


def test_resolve_idle_poll_rules(monkeypatch):
    resolve = doorbell_module.resolve_idle_poll
    monkeypatch.delenv(doorbell_module.IDLE_POLL_ENV, raising=False)
    if doorbell_module._c is None:
        assert resolve(True, cpu_bound=True) is False  # nothing to idle-poll with
        return
    assert resolve(True, cpu_bound=False) is True and resolve(False, cpu_bound=True) is False
    with pytest.raises(ValueError, match="idle_poll must be True, False or 'auto', got 'on'"):
        resolve("on", cpu_bound=True)
    monkeypatch.setattr(doorbell_module, "wake_cost_ns", lambda: doorbell_module.SLOW_WAKE_NS * 2)
    assert resolve("auto", cpu_bound=True) is True
    assert resolve("auto", cpu_bound=False) is False  # threaded workers of sleeping envs: off
    monkeypatch.setattr(doorbell_module, "wake_cost_ns", lambda: doorbell_module.SLOW_WAKE_NS // 4)
    assert resolve("auto", cpu_bound=True) is False  # idle cores wake fast: nothing to save
    monkeypatch.setattr(doorbell_module, "wake_cost_ns", lambda: None)
    assert resolve("auto", cpu_bound=True) is False
    for value, on in (("1", True), ("0", False), ("false", False), ("Off", False), ("yes", True)):
        # the environment variable decides "auto"
        monkeypatch.setenv(doorbell_module.IDLE_POLL_ENV, value)
        assert resolve("auto", cpu_bound=False) is on and resolve("auto", cpu_bound=True) is on
        assert resolve(not on, cpu_bound=True) is (not on)  # a value given beats it


def test_a_fork_server_started_without_torch_is_warned_about_once():
    # in a fresh interpreter (this test process's fork server already runs, with the preload),
    # loading the module from its file: it needs only multiprocessing, not torch
    import torchrl_asyncpool._sys.forkserver as module

    code = textwrap.dedent(f"""
        import importlib.util, multiprocessing as mp, warnings
        spec = importlib.util.spec_from_file_location("forkserver_under_test", {module.__file__!r})
        module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
        forkserver_context = module.forkserver_context
        with warnings.catch_warnings(record=True) as fresh:
            warnings.simplefilter("always")
            forkserver_context()  # nothing runs yet: nothing to say
        other = mp.get_context("forkserver")
        other.set_forkserver_preload(["os"])  # other code, with its own preload, starts the fork server
        p = other.Process(target=int)
        p.start(); p.join()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = forkserver_context("AsyncEnvPool")
            forkserver_context("AsyncEnvPool")
        assert not fresh, fresh
        assert len(caught) == 1 and caught[0].category is RuntimeWarning, caught
        text = str(caught[0].message)
        assert "AsyncEnvPool" in text and "set_forkserver_preload" in text, text
        assert ctx.get_start_method() == "forkserver"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_layout_alignment():
    layout = ArenaLayout(3, {"x": ((5,), torch.uint8)}, {"y": ((), torch.float64)})
    assert all(off % 64 == 0 for off in layout.offsets.values())


def test_step_type_and_discount():
    assert [int(s) for s in StepType] == [0, 1, 2, 3]
    st = torch.tensor([0, 1, 2, 3], dtype=torch.int8)
    assert discount_from_step_type(st).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert StepType.TRUNCATION.is_last() and not StepType.MID.is_last()


def test_fresh_batch_tensordicts_share_rows_but_not_keys(monkeypatch):
    # the consumer hands each batch out as a new TensorDict over cached staging rows: a key a
    # policy adds to one batch must not appear in the next, nested entries included, with
    # tensordict's fast constructor and with the public fallback
    from tensordict import TensorDict

    from torchrl_asyncpool.exchange import consumer

    staging = TensorDict({"obs": torch.arange(8.0).view(4, 2), "nest": {"x": torch.zeros(4, 3)}}, [4])
    tree = consumer._leaf_tree(staging[:3])
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(consumer, "_NEW_UNSAFE", None)
        first = consumer._fresh_td(tree, 3)
        assert first.batch_size == (3,) and first["nest", "x"].shape == (3, 3)
        first.set("action", torch.ones(3))
        first.set(("nest", "y"), torch.ones(3))
        second = consumer._fresh_td(tree, 3)
        assert "action" not in second.keys() and ("nest", "y") not in second.keys(True)
        second["obs"][0, 0] = 42.0  # the rows themselves are shared with the staging buffer
        assert staging["obs"][0, 0] == 42.0
        staging["obs"][0, 0] = 0.0


@pytest.mark.skipif(doorbell_module._c is None, reason="idle polling is in the C extension")
def test_a_starved_idle_poller_turns_the_process_to_blocking_waits_for_a_while():
    """A busy process on the waiter's only CPU keeps the SCHED_IDLE poller from running, so each
    idle-polled wait is woken by its own 1 ms check, late; past enough late wakes the process's
    waits block in poll(2) for a while (a backoff), and every ring is still seen."""
    c = doorbell_module._c
    mask = os.sched_getaffinity(0)
    cpu = min(mask)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    bell = Doorbell()
    stop = threading.Event()

    def ring():
        while not stop.is_set():
            time.sleep(0.002)
            bell.ring()

    ringer = threading.Thread(target=ring)
    os.sched_setaffinity(0, {cpu})  # this thread; the poller follows the mask of the thread that parks
    try:
        time.sleep(0.2)  # the busy loop is running
        late0, _, backoffs0 = c.idle_stats()
        ringer.start()
        waiter = BellWait(bell, idle_poll=True)
        for _ in range(400):
            assert waiter.wait(30.0) == [bell.fd]
            late, _, backoffs = c.idle_stats()
            if backoffs > backoffs0:
                break
        # (the count that triggers it is net of timely wakes and may include earlier tests' late ones)
        assert late > late0 and backoffs > backoffs0, (late - late0, backoffs - backoffs0)
        for _ in range(20):  # backing off: the waits block in poll(2) and still see every ring
            assert waiter.wait(30.0) == [bell.fd]
    finally:
        stop.set()
        os.sched_setaffinity(0, mask)
        busy.kill()
        busy.wait()
        if ringer.is_alive():
            ringer.join(10.0)
        bell.close()
