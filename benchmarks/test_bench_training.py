"""Smoke tests of ``compare_training.py --quick``: the scripts run, their CSV logs are read back,
and the JSON (commit, date, curves) and the PNG are written.

Not part of the main test run; run it explicitly::

    pytest benchmarks/test_bench_training.py               # this package's collector, PPO
    pytest benchmarks/test_bench_training.py -m torchrl    # every script against its --collector torchrl run
"""
from __future__ import annotations

import json

import pytest

import compare_training as ct  # noqa: E402  (benchmarks/ is put on sys.path by conftest.py)


def _check(out, runs: int) -> dict:
    result = json.loads(out.read_text())
    assert len(result["commit"]) == 40 and result["date_utc"] and result["quick"]
    assert len(result["runs"]) == runs
    for run in result["runs"]:
        assert run["returncode"] == 0, run.get("output_tail")
        assert run["curve"] and run["curve"][-1]["frames"] > 0
        assert all(p["time_s"] > 0 for p in run["curve"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


@pytest.mark.timeout(600)
def test_quick_ppo_with_this_collector_writes_the_curve_json_and_png(tmp_path):
    pytest.importorskip("mujoco")
    pytest.importorskip("matplotlib")
    out = tmp_path / "training.json"
    ct.main(["--quick", "--scripts", "ppo_mujoco", "--collectors", "asyncpool", "--seeds", "0", "--out", str(out)])
    run = _check(out, 1)["runs"][0]
    assert run["curve"][-1]["frames"] == 2560
    assert any(p["mean_return"] is not None for p in run["curve"])  # 2 envs: their 1,000-step episodes ended


@pytest.mark.torchrl
@pytest.mark.timeout(3600)
def test_quick_every_script_against_its_torchrl_run(tmp_path):
    pytest.importorskip("mujoco")
    pytest.importorskip("ale_py")
    pytest.importorskip("matplotlib")
    out = tmp_path / "training.json"
    ct.main(["--quick", "--seeds", "0", "--out", str(out)])
    result = _check(out, 6)
    assert {(r["script"], r["collector"]) for r in result["runs"]} == {
        (s, c) for s in ct.RUNS for c in ct.COLLECTORS}


def test_script_args_come_last_and_stop_at_target_reaches_sac(tmp_path):
    args = ct.parse_args(["--scripts", "sac_mujoco", "--total-frames", "15000", "--stop-at-target",
                          "--script-args", "--init-random-frames 5000 --total-frames 9000"])
    cmd = ct.command("sac_mujoco", "asyncpool", 0, tmp_path, args)
    assert cmd[-4:] == ["--init-random-frames", "5000", "--total-frames", "9000"]
    assert cmd[cmd.index("--stop-at-target") + 1] == "true"
    assert cmd[cmd.index("--total-frames") + 1] == "15000"  # the cap, then the script args override it
