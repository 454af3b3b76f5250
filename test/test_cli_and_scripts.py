"""Smoke tests of the training scripts (sota-implementations/) and the ``torchrl-asyncpool`` command.

The fast tests run every script for a few iterations in a subprocess (tiny ``--total-frames``)
and check the exit status, the CSV metrics and the learning-curve PNG. The full training runs,
which must reach the 475 target, are opt-in: ``python -m pytest -m slow test/test_cli_and_scripts.py``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_address, load_benchmark_script, load_script, run_checked
from torchrl_asyncpool import cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "sota-implementations"


def _cli_command() -> list[str]:
    exe = shutil.which("torchrl-asyncpool", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "torchrl_asyncpool.cli"]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return run_checked(cmd, timeout, cwd=ROOT)


def _run_script(name: str, tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPTS / name), "--log-dir", str(tmp_path), "--exp-name", "run",
           "--progress", "false", *args]
    return _run(cmd, timeout)


def _check_outputs(tmp_path: Path, png: str) -> None:
    csv = tmp_path / "run" / "scalars" / "mean_return.csv"
    assert csv.is_file(), sorted(p.name for p in (tmp_path / "run").rglob("*"))
    rows = [line.split(",") for line in csv.read_text().splitlines()]
    assert rows and all(len(r) == 2 for r in rows)
    assert (tmp_path / "run" / "scalars" / "batch_fill_ratio.csv").is_file()
    # the collector's own health metrics and server statistics (AsyncPoolCollector.log_metrics)
    assert (tmp_path / "run" / "scalars" / "collector" / "pool" / "consumer_busy_fraction.csv").is_file()
    assert (tmp_path / "run" / "scalars" / "collector" / "server" / "inference_time_s.csv").is_file()
    image = tmp_path / "run" / png
    assert image.is_file() and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- smoke: a few iterations of each script ------------------------------------------------------
def _scalar(tmp_path: Path, name: str) -> list[float]:
    return [float(line.split(",")[1]) for line in (tmp_path / "run" / "scalars" / f"{name}.csv").read_text().split()]


@pytest.mark.timeout(300)
def test_ppo_script_smoke(tmp_path):
    # the last batch holds the one frame left (2049 = 4 x 512 + 1): a minibatch of one, whose
    # advantage std is NaN, made the weights NaN; and the annealed lr was 0 for the last update
    proc = _run_script("ppo_cartpole.py", tmp_path, "--total-frames", "2049", "--frames-per-batch", "512",
                       "--num-envs", "4", "--epochs", "2")
    assert "not reached" in proc.stdout
    _check_outputs(tmp_path, "ppo_cartpole.png")
    assert len((tmp_path / "run" / "scalars" / "policy_lag.csv").read_text().splitlines()) == 5
    assert all(math.isfinite(x) for x in _scalar(tmp_path, "loss_policy") + _scalar(tmp_path, "loss_value"))
    lrs = _scalar(tmp_path, "lr")
    assert lrs[0] == 1e-3 and 0 < lrs[-1] < lrs[0]


@pytest.mark.timeout(300)
def test_ppo_script_smoke_with_vector_envs(tmp_path):
    proc = _run_script("ppo_cartpole.py", tmp_path, "--total-frames", "1024", "--frames-per-batch", "512",
                       "--num-envs", "8", "--vector-envs", "4", "--epochs", "1")
    assert "not reached" in proc.stdout
    _check_outputs(tmp_path, "ppo_cartpole.png")


@pytest.mark.timeout(300)
def test_ppo_script_smoke_with_remote_env_hosts(tmp_path):
    """The envs run in one spawned ``torchrl-asyncpool env-host --num-envs 4`` process that
    feeds the collector's RemoteEnvSlot slots over gRPC."""
    pytest.importorskip("grpc")
    proc = _run_script("ppo_cartpole.py", tmp_path, "--total-frames", "1024", "--frames-per-batch", "512",
                       "--num-envs", "4", "--epochs", "1", "--remote-address", free_address("127.0.0.1"),
                       "--spawn-hosts", "true")
    assert "not reached" in proc.stdout
    assert proc.stdout.count("steps of CartPole-v1 served to slot") == 4  # each host left when the pool closed
    _check_outputs(tmp_path, "ppo_cartpole.png")


@pytest.mark.timeout(300)
def test_impala_script_smoke(tmp_path):
    # the last batch holds one frame (1025 = 4 x 256 + 1): its normalised advantage was NaN
    proc = _run_script("impala_cartpole.py", tmp_path, "--total-frames", "1025", "--frames-per-batch", "256",
                       "--num-envs", "4")
    assert "not reached" in proc.stdout
    _check_outputs(tmp_path, "impala_cartpole.png")
    assert (tmp_path / "run" / "scalars" / "policy_lag_mean.csv").is_file()
    assert all(math.isfinite(x) for x in _scalar(tmp_path, "loss_policy") + _scalar(tmp_path, "loss_value"))


@pytest.mark.timeout(300)
def test_dqn_script_smoke(tmp_path):
    proc = _run_script("dqn_cartpole.py", tmp_path, "--total-frames", "2000", "--learning-starts", "500",
                       "--num-envs", "4", "--log-interval", "50")
    assert "not reached" in proc.stdout
    _check_outputs(tmp_path, "dqn_cartpole.png")
    assert (tmp_path / "run" / "scalars" / "updates.csv").is_file()


@pytest.mark.parametrize("script", ["ppo_cartpole.py", "impala_cartpole.py", "dqn_cartpole.py"])
def test_script_config_flags(script):
    """Every config field is a flag, and --help documents the defaults and what a field means
    (its comment in the Config block, continuation lines included)."""
    proc = _run([sys.executable, str(SCRIPTS / script), "--help"], timeout=120)
    text = " ".join(proc.stdout.split())  # argparse wraps the help text
    for flag in ("--total-frames", "--num-envs", "--log-dir", "--target-return"):
        assert flag in proc.stdout
    assert "--total-frames TOTAL_FRAMES hard stop (default:" in text
    assert "episodes in the moving mean of the return (default: 20)" in text
    assert f"--exp-name EXP_NAME default: {script[:-3]}_<time> --plot-path" in text  # the block's last lines too
    if script == "ppo_cartpole.py":
        assert "--gae-lambda" in proc.stdout
        assert "num_envs / vector_envs of them, each stepped in lockstep by one worker (default: 0)" in text


@pytest.mark.parametrize("script, args, message", [
    ("ppo_cartpole", ["--progress", "flase"], "argument --progress: expected true or false, got 'flase'"),
    ("ppo_cartpole", ["--total-frames", "-1"], "--total-frames must be >= 1"),  # lr grew with the frames
    ("ppo_cartpole", ["--epochs", "0"], "--epochs must be >= 1"),  # torch.stack([]) after the first batch
    ("ppo_cartpole", ["--minibatch-size", "0"], "--minibatch-size must be >= 1"),
    ("ppo_cartpole", ["--num-envs", "8", "--vector-envs", "-2"], "must be a multiple of --vector-envs -2"),
    # the vector envs were built locally and the address silently ignored
    ("ppo_cartpole", ["--vector-envs", "4", "--remote-address", "127.0.0.1:1"], "cannot be combined"),
    ("ppo_cartpole", ["--spawn-hosts", "true"], "--spawn-hosts true needs --remote-address"),
    ("impala_cartpole", ["--sgd-steps", "0"], "--sgd-steps must be >= 1"),
    ("impala_cartpole", ["--normalize-advantage", "nope"], "expected true or false, got 'nope'"),
    ("dqn_cartpole", ["--total-frames", "-1"], "--total-frames must be >= 1"),  # stopped at once, 0 frames
    ("dqn_cartpole", ["--eps-decay-frames", "0"], "--eps-decay-frames must be >= 1"),  # ZeroDivisionError
    ("dqn_cartpole", ["--target-update-interval", "0"], "--target-update-interval must be >= 1"),
    ("dqn_cartpole", ["--tau", "0"], "--tau must be in (0, 1]"),
    ("dqn_cartpole", ["--utd", "0"], "--utd must be > 0"),
])
def test_script_flags_refuse_bad_values(script, args, message, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_config(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_script_bool_flags_and_defaults_parse():
    module = load_script("dqn_cartpole")
    assert module.parse_config([]) == module.Config()
    assert module.parse_config(["--double-dqn", "FALSE", "--progress", "on"]).double_dqn is False


def test_advantage_normalisation_of_a_single_transition_is_finite():
    """One ``normalize`` for PPO's minibatches and IMPALA's batches (the script's and the demo's
    learner step, :func:`torchrl_asyncpool.examples.impala.impala_update`)."""
    import torch

    from torchrl_asyncpool.examples.batches import normalize

    assert load_script("ppo_cartpole").normalize is normalize
    assert normalize(torch.tensor([2.5])).tolist() == [0.0]
    out = normalize(torch.tensor([1.0, 2.0, 3.0]))
    assert abs(out.mean().item()) < 1e-6 and abs(out.std().item() - 1) < 1e-6


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _worker_pids(pid: int) -> list[int]:
    """Env worker processes: the children of the script's forkserver."""
    pids = []
    for child in _descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            pids += [int(c) for c in Path(f"/proc/{child}/task/{child}/children").read_text().split()]
    return pids


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["ppo_cartpole.py", "dqn_cartpole.py"])  # iterator path, start() path
def test_script_stops_with_the_error_when_a_worker_dies(script, tmp_path):
    """SIGKILL of an env worker mid-training ends the script with a non-zero status and the error."""
    cmd = [sys.executable, str(SCRIPTS / script), "--log-dir", str(tmp_path), "--exp-name", "run",
           "--progress", "false", "--target-return", "1e9", "--total-frames", "100000000", "--log-interval", "10"]
    if script == "ppo_cartpole.py":
        cmd = cmd[:-2]  # no --log-interval: PPO logs every iteration
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        csv = tmp_path / "run" / "scalars" / "frames.csv"
        deadline = time.monotonic() + 200
        while not (csv.is_file() and csv.read_text().strip()):  # training has started
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the script did not start training"
            time.sleep(0.2)
        workers = _worker_pids(proc.pid)
        assert workers, "no env worker found"
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "WorkerDiedError" in err and "killed by signal 9" in err, err[-3000:]


# -- the torchrl-asyncpool command ---------------------------------------------------------------
def test_cli_help():
    proc = _run([*_cli_command(), "--help"], timeout=120)
    assert "demo" in proc.stdout and "bench" in proc.stdout and "eval" in proc.stdout
    assert "IMPALA" in proc.stdout


def test_cli_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_cli_env_host_refuses_a_step_limit_with_reconnect(capsys):
    """``--reconnect`` serves pool after pool with no step limit: ``--max-steps`` was ignored."""
    assert cli.main(["env-host", "--address", "127.0.0.1:1", "--reconnect", "--max-steps", "10"]) == 2
    assert "--max-steps does not apply with --reconnect" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_cli_demo_smoke():
    proc = _run([*_cli_command(), "demo", "--total-frames", "1024", "--num-envs", "4", "--no-progress"],
                timeout=240)
    assert "frames/s reached" in proc.stdout
    assert "final return" in proc.stdout


def test_demo_ends_on_a_one_frame_batch_with_a_finite_loss():
    """257 frames in batches of 256: the last batch holds one transition, whose advantage std
    is NaN; normalising by it made the loss (and then the weights) NaN."""
    import math

    out = cli.train_impala_demo(total_frames=257, num_envs=2, frames_per_batch=256, progress=False)
    assert out["frames"] == 257
    assert math.isfinite(out["last_loss"]), out


def test_cli_bench_missing_script(tmp_path, capsys):
    assert cli.main(["bench", "--script", str(tmp_path / "missing.py")]) == 2
    assert "was not found" in capsys.readouterr().err


def test_cli_bench_runs_script_with_arguments(tmp_path, capsys):
    script = tmp_path / "fake_bench.py"
    script.write_text("import sys\nprint('ARGS', sys.argv[1:])\nif '--fail' in sys.argv:\n    sys.exit(3)\n")
    assert cli.main(["bench", "--script", str(script), "--", "--quick", "--envs", "4"]) == 0
    assert "ARGS ['--quick', '--envs', '4']" in capsys.readouterr().out
    assert cli.main(["bench", "--script", str(script), "--fail"]) == 3


def test_cli_bench_default_script_gets_a_plot_path(tmp_path, capsys, monkeypatch):
    script = tmp_path / "compare_collectors.py"
    script.write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    monkeypatch.setattr(cli.bench, "_default_benchmark", lambda: script)
    assert cli.main(["bench", "--quick"]) == 0
    assert "ARGS ['--quick', '--plot', 'compare_collectors.png']" in capsys.readouterr().out
    assert cli.main(["bench", "--plot", "", "--quick"]) == 0
    assert "ARGS ['--quick']" in capsys.readouterr().out
    assert cli.main(["bench", "--", "--plot", "mine.png"]) == 0
    assert "ARGS ['--plot', 'mine.png']" in capsys.readouterr().out


def test_cli_bench_without_matplotlib_runs_without_the_default_plot(tmp_path, capsys, monkeypatch):
    """``bench --quick`` with no matplotlib: the default plot is skipped with a one-line notice and
    the benchmark runs; a plot asked for explicitly is refused (status 2) before anything runs."""
    script = tmp_path / "compare_collectors.py"
    script.write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    monkeypatch.setattr(cli.bench, "_default_benchmark", lambda: script)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert cli.main(["bench", "--quick"]) == 0
    out, err = capsys.readouterr()
    assert "ARGS ['--quick']" in out
    assert err.strip().splitlines() == ["torchrl-asyncpool bench: matplotlib is not installed: no plot (pip install "
                                        "'torchrl-asyncpool[benchmarks]' for one)."]
    for args in (["--plot", "mine.png", "--quick"], ["--quick", "--", "--plot=mine.png"]):
        assert cli.main(["bench", *args]) == 2
        out, err = capsys.readouterr()
        assert "ARGS" not in out and "'mine.png' needs matplotlib" in err and "[benchmarks]" in err, err


def _run_profile_collector(tmp_path, *args):
    """Runs ``benchmarks/profile_collector.py`` with ``args``; its process and its JSON result."""
    out = tmp_path / "profile.json"
    script = ROOT / "benchmarks" / "profile_collector.py"
    proc = _run([sys.executable, str(script), *args, "--json", str(out)], timeout=240)
    return proc, json.loads(out.read_text())


def test_profile_collector_script(tmp_path):
    """``benchmarks/profile_collector.py`` on a tiny cell: the cycle parts add up to the cycle, and
    the CPU table names the serving thread and each env worker."""
    proc, r = _run_profile_collector(tmp_path, "--workload", "cartpole", "--envs", "4", "--seconds", "0.5",
                                     "--policy", "zero", "--set", "envs_per_worker=2")
    assert "frames/s" in proc.stdout and "CPU per frame" in proc.stdout
    assert r["frames_per_s"] > 0 and r["collector_kwargs"] == {"envs_per_worker": "2"}
    parts = r["cycle_us"]
    assert abs(sum(v for k, v in parts.items() if k != "total") - parts["total"]) < 1e-6 * parts["total"] + 1e-3
    what = [c["what"] for c in r["cpu"]]
    assert any("torchrl_asyncpool-inference" in w for w in what), what
    assert sum(w.startswith("process: env worker") for w in what) == 2, what
    # a worker's idle poller, when it ran, has a line of its own that names the worker
    assert all("of env worker" in w for w in what if w.startswith("idle poller")), what
    # each worker's own frames (those of its two envs) are a part of all, so its CPU per own frame
    # is at least its CPU per delivered frame
    workers = [c for c in r["cpu"] if c["what"].startswith("process: env worker")]
    assert all(c["own_frames"] > 0 for c in workers), workers
    assert all(c["us_per_own_frame"] >= c["user_us_per_frame"] + c["system_us_per_frame"] for c in workers), workers


@pytest.mark.parametrize("policy", ["mlp", "zero"])
def test_profile_collector_script_on_mujoco(tmp_path, policy):
    """The real workloads profile too: ``--workload mujoco`` is compare_real.py's HalfCheetah-v5
    stack, with its policy or a zero float64 action."""
    pytest.importorskip("mujoco")
    proc, r = _run_profile_collector(tmp_path, "--workload", "mujoco", "--envs", "2", "--seconds", "0.5",
                                     "--policy", policy, "--frames-per-batch", "64")
    assert "mujoco, 2 envs" in proc.stdout, proc.stdout
    assert r["workload"] == "mujoco" and r["frames_per_s"] > 0 and r["cycle_us"]["env step"] > 0


def test_profile_collector_script_hosts_envpool(tmp_path):
    """``--stack envpool`` profiles compare_real.py's ours_envpool cell: EnvPool's own HalfCheetah,
    one vector env per core in the pool's workers."""
    pytest.importorskip("mujoco")
    pytest.importorskip("envpool")
    proc, r = _run_profile_collector(tmp_path, "--workload", "mujoco", "--envs", "4", "--seconds", "0.5",
                                     "--stack", "envpool", "--frames-per-batch", "64")
    assert "mujoco (envpool stack), 4 envs" in proc.stdout, proc.stdout
    assert r["frames_per_s"] > 0
    workers = [c for c in r["cpu"] if c["what"].startswith("process: env worker")]
    assert 1 <= len(workers) <= 2, r["cpu"]  # one vector env per core, not one process per env


def test_profile_collector_refuses_envpool_for_a_toy_workload():
    module = load_benchmark_script("profile_collector")
    with pytest.raises(ValueError, match="stack 'envpool' hosts EnvPool's own envs"):
        module.profile("cartpole", 2, 0.1, stack="envpool")
    with pytest.raises(ValueError, match="stack must be 'gym', 'envpool' or 'torchrl'"):
        module.profile("mujoco", 2, 0.1, stack="brax")
    with pytest.raises(ValueError, match="stack 'torchrl' is compare_real.py's ours_torchrl cell"):
        module.profile("cartpole", 2, 0.1, stack="torchrl")
    with pytest.raises(ValueError, match="stack 'torchrl' is compare_real.py's ours_torchrl cell"):
        module.profile("mujoco", 2, 0.1, policy="zero", stack="torchrl")


def test_profile_collector_script_steps_torchrl_factories(tmp_path):
    """``--stack torchrl`` profiles compare_real.py's ours_torchrl cell: TorchRL factories of the
    MuJoCo stack (float32 actions after ``DoubleToFloat``), stepped on the fast path."""
    pytest.importorskip("mujoco")
    proc, r = _run_profile_collector(tmp_path, "--workload", "mujoco", "--envs", "2", "--seconds", "0.5",
                                     "--stack", "torchrl", "--frames-per-batch", "64")
    assert "mujoco (torchrl stack), 2 envs" in proc.stdout, proc.stdout
    assert r["stack"] == "torchrl" and r["frames_per_s"] > 0 and r["cycle_us"]["env step"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and names threads through /proc")
def test_profile_collector_finds_a_process_idle_poller():
    """The CPU of a process's ``asyncpool-idle`` thread(s) is found by the thread's kernel name,
    which is how the C idle poller names itself; no such process gives None."""
    import threading

    module = load_benchmark_script("profile_collector")
    started, stop = threading.Event(), threading.Event()

    def spin():
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write("asyncpool-idle")  # the name idle_poll.c gives its thread
        started.set()
        t0 = time.process_time()
        while not stop.is_set() and time.process_time() - t0 < 0.3:
            pass
        stop.wait()

    # this test process may already run a real idle poller (an earlier test's pool waited here)
    before = module._idle_poller_cpu(os.getpid()) or (0.0, 0.0, 0)
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert started.wait(10.0)
        time.sleep(0.5)
        found = module._idle_poller_cpu(os.getpid())
        assert found is not None and found[0] + found[1] - before[0] - before[1] > 0.05, (before, found)
    finally:
        stop.set()
        thread.join()
    assert module._idle_poller_cpu(2**22 + 7) is None  # no such process


def test_profile_collector_rejects_a_bad_set(capsys):
    module = load_benchmark_script("profile_collector")
    assert module._kwarg("envs_per_worker=8") == ("envs_per_worker", 8)
    assert module._kwarg("exchange=python") == ("exchange", "python")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--set", "not a kwarg"])
    assert exit_info.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="policy must be"):
        module.profile("cartpole", 2, 0.1, policy="random")


def test_ab_commits_rejects_bad_counts():
    script = ROOT / "benchmarks" / "ab_commits.py"
    proc = subprocess.run([sys.executable, str(script), "--base", "HEAD", "--pairs", "0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--pairs must be >= 1" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_ab_commits_runs_pairs_in_abba_order_and_removes_its_worktree():
    script = ROOT / "benchmarks" / "ab_commits.py"
    before = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    proc = _run([sys.executable, str(script), "--base", "HEAD", "--workload", "cartpole", "--envs", "4",
                 "--pairs", "2", "--seconds", "0.5"], timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pair ")]
    assert [line.split()[2] for line in lines] == ["base", "new", "new", "base"], proc.stdout
    assert "median frames/s" in proc.stdout and "new/base per pair" in proc.stdout
    after = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before


# -- full runs (opt-in): each reaches the 475 target ----------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("script", ["ppo_cartpole.py", "impala_cartpole.py", "dqn_cartpole.py"])
def test_script_reaches_target(script, tmp_path):
    proc = _run_script(script, tmp_path, timeout=1700)
    assert "Target 475 reached" in proc.stdout, proc.stdout[-2000:]
    _check_outputs(tmp_path, script.replace(".py", ".png"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ppo_reaches_target_with_remote_env_hosts(tmp_path):
    pytest.importorskip("grpc")
    proc = _run_script("ppo_cartpole.py", tmp_path, "--remote-address", free_address("127.0.0.1"),
                       "--spawn-hosts", "true", timeout=1700)
    assert "Target 475 reached" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cli_demo_reaches_target():
    proc = _run([*_cli_command(), "demo", "--no-progress"], timeout=1100)
    assert "[target 475 reached" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.timeout(300)
def test_cli_eval_writes_one_result_per_episode(tmp_path):
    manifest = tmp_path / "episodes.json"
    episodes = [{"episode_id": "short", "seed": 3, "max_steps": 4}, {"episode_id": "free", "seed": 4}]
    manifest.write_text(json.dumps(episodes))
    out = tmp_path / "results.json"
    proc = _run([*_cli_command(), "eval", "--manifest", str(manifest), "--output", str(out), "--num-envs", "2",
                 "--no-progress"], timeout=240)
    assert "2 episodes" in proc.stdout and "0 failed" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert [e["episode_id"] for e in data["episodes"]] == ["short", "free"]
    assert data["episodes"][0]["status"] == "timeout" and data["episodes"][0]["length"] == 4
    assert data["episodes"][1]["status"] == "completed" and data["summary"]["completed"] == 1


def test_cli_eval_validate_only_and_bad_input(tmp_path, capsys):
    manifest = tmp_path / "episodes.json"
    manifest.write_text(json.dumps([{"episode_id": "a", "seed": 1}]))
    assert cli.main(["eval", "--manifest", str(manifest), "--validate-only"]) == 0
    assert "1 episodes of CartPole-v1 are valid" in capsys.readouterr().out
    manifest.write_text(json.dumps([{"episode_id": "a", "seed": "one"}]))
    assert cli.main(["eval", "--manifest", str(manifest), "--validate-only"]) == 2
    assert "seed must be None or an int" in capsys.readouterr().err
    assert cli.main(["eval", "--env-id", "NoSuchEnv-v0", "--validate-only"]) == 2
    assert "NoSuchEnv" in capsys.readouterr().err
    assert cli.main(["eval", "--policy", "nomodule", "--validate-only"]) == 2
    assert "MODULE:FACTORY" in capsys.readouterr().err
    assert cli.main(["eval", "--device", "meta", "--validate-only"]) == 2
    assert "CPU or CUDA device, got 'meta'" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_cli_eval_capacity_smoke(capsys):
    assert cli.main(["eval", "--episodes", "5", "--num-envs", "3", "--capacity-smoke"]) == 0
    out = capsys.readouterr().out
    assert "capacity smoke: 3 envs of CartPole-v1 built and reset" in out and "nothing was stepped" in out


@pytest.mark.timeout(300)
def test_cli_eval_ctrl_c_drains_and_writes_every_result(tmp_path, capsys):
    """The first Ctrl-C lets the running episodes finish and writes one result per episode."""
    import threading

    out = tmp_path / "results.json"
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    code = cli.main(["eval", "--episodes", "3000", "--num-envs", "2", "--output", str(out), "--no-progress"])
    assert code == 130
    assert "stopping: the running episodes finish" in capsys.readouterr().err
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == 3000
    statuses = {e["status"] for e in episodes}
    assert statuses <= {"completed", "failed", "timeout"}
    assert any(e.get("error") == "not started: the evaluation was stopped" for e in episodes)
