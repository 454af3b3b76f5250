"""How the ``torchrl-asyncpool`` command fails: bad arguments, missing extras, Ctrl-C, policy errors.

Each test runs the real command in a subprocess, as a user would: an argument error is one line
naming the option and exit status 2; a missing optional extra names the extra; Ctrl-C (sent to
the whole process group, as a terminal sends it) ends in exit status 130 with a one-line summary
and no traceback, and nothing the command started outlives it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from torchrl_asyncpool import cli

ROOT = Path(__file__).resolve().parents[1]


def _cli_command() -> list[str]:
    exe = shutil.which("torchrl-asyncpool", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "torchrl_asyncpool.cli"]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the package is installed; nothing else may leak in
    return env


def _run(args, cwd=ROOT, timeout=180, python_prelude=None) -> subprocess.CompletedProcess:
    if python_prelude is None:
        cmd = _cli_command() + list(args)
    else:  # the CLI's main() after some set-up in the same interpreter (e.g. an extra made missing)
        code = f"import sys; {python_prelude}; from torchrl_asyncpool.cli import main; sys.exit(main({list(args)!r}))"
        cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


# -- argument errors: exit 2, one line naming the option --------------------------------------------
@pytest.mark.parametrize("args,flag", [
    (["demo", "--num-envs", "0"], "--num-envs"),  # was a ZeroDivisionError
    (["demo", "--frames-per-batch", "0"], "--frames-per-batch"),  # was a traceback
    (["demo", "--total-frames", "-5"], "--total-frames"),
    (["demo", "--num-envs", "eight"], "--num-envs"),
    (["demo", "--env-id", "CartPol-v1"], "--env-id"),  # was gymnasium's 20-line traceback
    (["demo", "--env-id", "Pendulum-v1"], "--env-id"),  # a continuous action: the demo cannot train it
    (["eval", "--num-envs", "0", "--validate-only"], "--num-envs"),
    (["env-host", "--num-envs", "0", "--address", "localhost:1"], "--num-envs"),
    (["env-host", "--address", "nonsense"], "--address"),  # waited the 30 s connect timeout before
    (["env-host", "--address", "localhost:0", "--protocol", "2"], "--address"),
    (["demo", "--no-such-flag"], "--no-such-flag"),
])
def test_an_argument_error_exits_2_with_one_line_naming_the_option(args, flag):
    proc = _run(args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# -- missing optional extras: non-zero exit naming the extra, before anything runs ------------------
def test_bench_without_matplotlib_names_the_benchmarks_extra_before_running():
    # a plot asked for explicitly; the default one is skipped with a notice instead (test_cli_and_scripts)
    proc = _run(["bench", "--plot", "out.png", "--quick", "--impls", "gym_sync"],
                python_prelude="sys.modules['matplotlib'] = None")
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "torchrl-asyncpool[benchmarks]" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Running" not in proc.stdout  # refused before the benchmark ran (it used to crash after its table)
    assert "torchrl-asyncpool[benchmarks]" in _run(["bench", "--help"]).stdout


def test_env_host_without_grpcio_names_the_remote_extra():
    proc = _run(["env-host", "--address", "localhost:1", "--connect-timeout", "1"],
                python_prelude="sys.modules['grpc'] = None")
    assert proc.returncode != 0, (proc.stdout[-2000:], proc.stderr[-3000:])  # it used to exit 0
    assert "torchrl-asyncpool[remote]" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# -- eval's --policy and its errors ---------------------------------------------------------------
def test_eval_imports_a_policy_module_from_the_current_directory(tmp_path):
    (tmp_path / "mypol_cwd.py").write_text(
        "import torch\n\n"
        "def load_policy():\n"
        "    return lambda td: td.set('action', torch.zeros(td.shape[0], dtype=torch.int64))\n"
    )
    proc = _run(["eval", "--policy", "mypol_cwd:load_policy", "--episodes", "2", "--validate-only"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]  # it said "No module named 'mypol_cwd'"
    assert "are valid" in proc.stdout


def test_an_eval_policy_error_is_printed_once(tmp_path):
    (tmp_path / "raising_pol.py").write_text(
        "def load_policy():\n"
        "    def policy(td):\n"
        "        raise RuntimeError('policy-' + 'exploded.')\n"  # the message is not in the source line
        "    return policy\n"
    )
    out = tmp_path / "results.json"
    proc = _run(["eval", "--policy", "raising_pol:load_policy", "--episodes", "2", "--num-envs", "1",
                 "--no-progress", "--output", str(out)], cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    # the policy's traceback once (ending in its message) and the summary line: nothing twice, no ".."
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-4000:]
    assert proc.stderr.count("policy-exploded") == 2, proc.stderr[-4000:]
    assert ".." not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("torchrl-asyncpool eval: the evaluation failed")
    assert len(json.loads(out.read_text())["episodes"]) == 2


# -- the demo's progress bar ----------------------------------------------------------------------
def test_the_demo_bar_shows_one_rate():
    proc = _run(["demo", "--total-frames", "1024", "--num-envs", "2", "--frames-per-batch", "256"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    bar = [line for line in proc.stderr.replace("\r", "\n").splitlines() if "frames/s" in line]
    assert bar, proc.stderr[-3000:]
    assert not any("fps=" in line for line in bar), bar[-1]  # it showed tqdm's rate and its own, which disagreed


# -- Ctrl-C ---------------------------------------------------------------------------------------
class _Command:
    """The CLI in a session of its own; its output (stdout and stderr) is read as it comes."""

    def __init__(self, args, cwd):
        self.proc = subprocess.Popen(_cli_command() + list(args), cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._chunks = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while True:
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return
            self._chunks.append(chunk)

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace").replace("\r", "\n")

    def wait_for(self, predicate, timeout=180.0):
        deadline = time.monotonic() + timeout
        while not predicate(self):
            assert self.proc.poll() is None, f"the command ended early:\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"not reached within {timeout} s:\n{self.output[-3000:]}"
            time.sleep(0.02)

    def descendants(self) -> list:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def has_descendant(self, marker: str) -> bool:
        """Whether a process below the command has ``marker`` in its command line."""
        def matches(p):
            try:
                return marker in " ".join(p.cmdline())
            except psutil.Error:
                return False

        return any(matches(p) for p in self.descendants())

    def fork_server_started(self) -> bool:
        return self.has_descendant("forkserver")

    def ctrl_c(self, within=30.0, sig=signal.SIGINT):
        """Ctrl-C to the whole group (``sig=SIGTERM``: to the command's process only, as a job
        scheduler sends it); returns (exit status, seconds to exit, output)."""
        started = self.descendants()
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"no exit within {within} s of Ctrl-C:\n{self.output[-3000:]}")
        took = time.monotonic() - t0
        self._reader.join(10)
        _none_left(started)
        return self.proc.returncode, took, self.output

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _none_left(processes, within=30.0):
    # no time is promised for these (the command's own exit is): on a loaded 2-core machine (load 10-20)
    # a worker or the fork server may take seconds to finish exiting; only one still there well past
    # that is left behind
    deadline = time.monotonic() + within
    while True:
        alive = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes left behind after Ctrl-C: {alive}"
        time.sleep(0.1)


def _one_summary_line(output: str, starts: str) -> None:
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(starts), output[-3000:]


# The promise is 2 s; the bounds below are generous multiples, for a loaded 2-core machine.
EXIT_BOUND_S = 10.0


def _stopped(code: int, took: float, output: str, status: int) -> None:
    """The command exited with ``status`` (130: Ctrl-C, 143: SIGTERM) within the bound."""
    assert code == status, output[-3000:]
    assert took < EXIT_BOUND_S, f"{took:.1f} s"


def _all_not_started(out, n: int) -> None:
    """The results file holds ``n`` episodes, all written "not started"."""
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == n and all(e["error"].startswith("not started") for e in episodes), episodes[:3]


def test_ctrl_c_while_the_demo_starts_exits_130_without_a_traceback(tmp_path):
    """Ctrl-C while the fork server imports torch (a terminal sends it to every process): the
    fork server used to die with a traceback of its own."""
    cmd = _Command(["demo", "--no-progress"], tmp_path)
    try:
        cmd.wait_for(_Command.fork_server_started)
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    _one_summary_line(output, "torchrl-asyncpool demo: interrupted")


def test_ctrl_c_while_the_demo_trains_exits_130_with_a_summary(tmp_path):
    cmd = _Command(["demo"], tmp_path)
    try:
        # the bar moves: training runs (its first draw, "0/500000 [... ?frames/s]", comes before the
        # first batch, while the pool may still be starting: that moment is another test's)
        cmd.wait_for(lambda c: re.search(r"\b[1-9][0-9]*/[0-9]+ \[", c.output))
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)  # it used to die by SIGINT after a 16-frame traceback
    _one_summary_line(output, "torchrl-asyncpool demo: interrupted after")


def test_ctrl_c_in_env_host_exits_130_with_a_summary(tmp_path):
    cmd = _Command(["env-host", "--address", "localhost:1", "--connect-timeout", "60"], tmp_path)
    try:
        cmd.wait_for(lambda c: "steps" in c.output)  # the bar: the hosts wait for the pool
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    _one_summary_line(output, "torchrl-asyncpool env-host: interrupted; 0 steps")


def test_ctrl_c_while_eval_starts_writes_every_result_and_exits_130(tmp_path):
    """Ctrl-C while the fork server imports torch: it used to kill the fork server, and eval
    then failed with BrokenPipeError/EOFError, "no results written", exit status 3; later the
    pool's start waited for the fork server's whole import (seconds idle, 14 s on a busy
    machine) before it could be abandoned. Now eval stops before any pool starts."""
    out = tmp_path / "results.json"
    cmd = _Command(["eval", "--episodes", "50", "--num-envs", "4", "--output", str(out)], tmp_path)
    try:
        cmd.wait_for(_Command.fork_server_started)
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    assert "Traceback" not in output and "no results written" not in output, output[-3000:]
    # stopped where it was, not by a drain that first waited for the fork server to answer
    _one_summary_line(output, "torchrl-asyncpool eval: interrupted before the first episode started; 50 episodes")
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == 50
    assert all(e["error"].startswith("not started") for e in episodes), episodes[:3]


def _importing_torch(cmd) -> bool:
    """The command's own process has loaded torch's library: it is importing torch (seconds)."""
    try:
        with open(f"/proc/{cmd.proc.pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def test_ctrl_c_while_eval_imports_torch_writes_every_result_and_exits_130(tmp_path):
    """Ctrl-C in eval's first seconds, while torch is imported (before any fork server): it said
    "interrupted." and wrote nothing; writing the results imported the evaluation package, torch
    and all. The episodes and their results file need no torch now."""
    out = tmp_path / "results.json"
    cmd = _Command(["eval", "--episodes", "30", "--num-envs", "2", "--output", str(out)], tmp_path)
    try:
        cmd.wait_for(_importing_torch)
        assert not cmd.fork_server_started()  # the moment this test is about: the command still imports torch
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    _one_summary_line(output, "torchrl-asyncpool eval: interrupted before the first episode started; 30 episodes")
    _all_not_started(out, 30)


def test_sigterm_while_eval_starts_writes_every_result_and_exits_143(tmp_path):
    """The help promises SIGTERM stops as Ctrl-C does; before the episodes ran, SIGTERM killed
    eval (status -15), with no results and no word."""
    out = tmp_path / "results.json"
    cmd = _Command(["eval", "--episodes", "20", "--num-envs", "2", "--output", str(out)], tmp_path)
    try:
        cmd.wait_for(_Command.fork_server_started)
        code, took, output = cmd.ctrl_c(sig=signal.SIGTERM)
    finally:
        cmd.kill()
    _stopped(code, took, output, 143)
    _one_summary_line(output, "torchrl-asyncpool eval: terminated (SIGTERM) before the first episode started; 20")
    _all_not_started(out, 20)


def test_ctrl_c_while_eval_runs_writes_every_result_and_exits_130(tmp_path):
    """The drain: the running episodes finish, the others are written "not started", and the
    summary is the last line (a resource-tracker warning about tqdm's semaphore used to follow it)."""
    out = tmp_path / "results.json"
    cmd = _Command(["eval", "--episodes", "3000", "--num-envs", "4", "--output", str(out)], tmp_path)
    try:
        cmd.wait_for(lambda c: re.search(r"\b[1-9][0-9]*/3000\b", c.output))  # episodes are finishing
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    assert "leaked" not in output, output[-3000:]
    _one_summary_line(output, "3000 episodes in")
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == 3000 and episodes[-1]["error"].startswith("not started"), episodes[-1]
    assert any(e["status"] == "completed" for e in episodes)


def test_ctrl_c_while_eval_runs_with_its_progress_bar_exits_as_fast_as_without(tmp_path):
    """With the bar on, every episode written "not started" on Ctrl-C redrew the bar and summed up
    all results so far: seconds for a few thousand episodes (1.7 s for 3000 against 0.1 s with
    --no-progress, idle), growing with the square of their number. Now one update for all."""
    out = tmp_path / "results.json"
    cmd = _Command(["eval", "--episodes", "12000", "--num-envs", "2", "--output", str(out)], tmp_path)
    try:
        cmd.wait_for(lambda c: re.search(r"\b[1-9][0-9]*/12000\b", c.output))  # the bar moves
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    _one_summary_line(output, "12000 episodes in")
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == 12000 and episodes[-1]["error"].startswith("not started"), episodes[-1]


def test_a_ctrl_c_as_the_command_exits_ends_in_one_line_and_130(tmp_path):
    """Once the command has returned, the process used to spend seconds in torch's destructors,
    and a Ctrl-C then killed it by SIGINT (or, during the atexit functions, printed a
    traceback). Here the Ctrl-C comes from an atexit function, as the process exits."""
    code = ("import atexit, os, signal, sys, time\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))\n"
            "from torchrl_asyncpool.cli import main\n"
            "sys.argv = ['torchrl-asyncpool', 'eval', '--episodes', '2', '--validate-only']\n"
            "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 130, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "2 episodes of CartPole-v1 are valid" in proc.stdout
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("torchrl-asyncpool eval: interrupted while exiting")


def test_a_ctrl_c_while_the_demo_shuts_down_reports_its_progress(monkeypatch):
    """Ctrl-C while the collector shuts down after the last batch: the summary said
    "interrupted before training started"."""
    from torchrl_asyncpool.collector import AsyncPoolCollector

    shutdown = AsyncPoolCollector.shutdown

    def interrupted_shutdown(self, *args, **kwargs):
        shutdown(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncPoolCollector, "shutdown", interrupted_shutdown)
    with pytest.raises(KeyboardInterrupt) as info:
        cli.train_impala_demo(total_frames=512, num_envs=2, frames_per_batch=256, progress=False)
    assert info.value.demo_progress["frames"] == 512, info.value.demo_progress


@pytest.mark.slow
def test_ctrl_c_in_bench_exits_130_with_a_summary(tmp_path):
    cmd = _Command(["bench", "--quick", "--impls", "asyncpool", "gym_sync", "--plot", ""], tmp_path)
    try:
        cmd.wait_for(lambda c: '"impl": "asyncpool"' in c.output)  # a row printed, the next cell runs
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)  # it used to die by SIGINT with a traceback
    _one_summary_line(output, "torchrl-asyncpool bench: interrupted")


def _spawned_worker_started(cmd) -> bool:
    """A worker process that TorchRL started (``spawn``: it re-imports the benchmark script)."""
    return cmd.has_descendant("multiprocessing.spawn")


@pytest.mark.slow
def test_ctrl_c_in_bench_while_torchrl_starts_its_workers_exits_130_without_their_tracebacks(tmp_path):
    """Ctrl-C while TorchRL's collector starts its worker processes (each importing torch for
    seconds): every worker printed a KeyboardInterrupt traceback of its own, and the collector,
    left to its default shutdown, held the exit 5-6 s on a busy machine."""
    cmd = _Command(["bench", "--quick", "--impls", "torchrl_async", "--plot", ""], tmp_path)
    try:
        cmd.wait_for(_spawned_worker_started)
        time.sleep(0.5)  # they are importing
        code, took, output = cmd.ctrl_c()
    finally:
        cmd.kill()
    _stopped(code, took, output, 130)
    _one_summary_line(output, "torchrl-asyncpool bench: interrupted")


def test_a_ctrl_c_that_no_command_catches_ends_in_one_line_and_130(monkeypatch, capsys):
    """E.g. a third Ctrl-C of eval, once its handlers are gone: 130 and one line, not a death by
    SIGINT."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.env_host, "_cmd_env_host", interrupted)
    assert cli.main(["env-host", "--address", "localhost:1"]) == 130
    assert capsys.readouterr().err.strip() == "torchrl-asyncpool env-host: interrupted."
