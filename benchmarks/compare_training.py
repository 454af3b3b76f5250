"""Training side by side: each MuJoCo/Atari training script against its ``--collector torchrl`` run.

In one sitting, one run after another (nothing else should be busy), this runs

* ``sota-implementations/ppo_mujoco.py``   (PPO, HalfCheetah-v5, 16 envs), seeds 0 and 1,
* ``sota-implementations/sac_mujoco.py``   (SAC, HalfCheetah-v5, 8 envs), seeds 0 and 1,
* ``sota-implementations/impala_atari.py`` (IMPALA, Pong, 12 envs), seed 0,

each with ``--collector asyncpool`` (this package's collector) and ``--collector torchrl``
(TorchRL's own collector as TorchRL's recipe uses it), the two collectors of one seed back to
back. Every script logs its metrics once per iteration through TorchRL's ``CSVLogger``
(``<log-dir>/<run>/scalars/<name>.csv``, ``step,value`` lines with the frames as step); this
reads ``frames``, ``time_s`` (wall-clock since the script's training loop started: the
collector's construction is not in it; each run's whole wall-clock, start-up included, is its
``wall_s``) and ``mean_return`` (the mean return of the script's window of recent training
episodes) from there, and writes

* a JSON (``--out``, default ``benchmarks/results_training.json``): the commit and date, the
  versions, every run's command, exit status, wall-clock and curve, and per run the frames and
  training seconds at which the mean return first reached the script's target (PPO 1,500, SAC
  3,000; none for Pong) with, per script and seed, the ``asyncpool / torchrl`` ratio of those seconds;
* a PNG next to it (same name, ``.png``): one row per script, return against wall-clock (left)
  and against frames (right), one line per collector and seed.

``--quick`` trains a few thousand frames per run (2 envs for the MuJoCo scripts, so that their
1,000-step episodes end and the curves get points; 4 for Pong, whose episodes outlast the run;
small batches; no evaluation): it checks the pipeline end to end, not the collectors. A quick
asyncpool run takes tens of seconds, a TorchRL one a minute or more, mostly its
``ParallelEnv``/``MultiaSyncDataCollector`` start-up. A full run (the scripts' defaults: 1M frames
for the MuJoCo scripts) takes hours per run on two cores; ``--total-frames`` caps it.

Run::

    python benchmarks/compare_training.py                              # everything (hours)
    python benchmarks/compare_training.py --scripts ppo_mujoco         # PPO only, seeds 0 and 1
    python benchmarks/compare_training.py --scripts ppo_mujoco --seeds 0 --stop-at-target  # time to 1,500
    python benchmarks/compare_training.py --quick                      # the pipeline in minutes
    python benchmarks/compare_training.py --quick --scripts ppo_mujoco --collectors asyncpool --seeds 0
    python benchmarks/compare_training.py --scripts sac_mujoco --seeds 0 --total-frames 15000 \\
        --script-args "--init-random-frames 5000 --eval-episodes 0" --out /tmp/sac_window.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = ROOT / "sota-implementations"

#: script -> (seeds, target mean return or None, the --quick arguments)
RUNS = {
    "ppo_mujoco": ((0, 1), 1500.0,
                   ("--num-envs", "2", "--frames-per-batch", "512", "--total-frames", "2560", "--epochs", "1",
                    "--minibatch-size", "256", "--eval-episodes", "0")),
    "sac_mujoco": ((0, 1), 3000.0,
                   ("--num-envs", "2", "--frames-per-batch", "250", "--total-frames", "2500",
                    "--init-random-frames", "1000", "--utd", "0.25", "--buffer-size", "10000",
                    "--log-interval", "500", "--eval-episodes", "0")),
    "impala_atari": ((0,), None,
                     ("--num-envs", "4", "--frames-per-batch", "120", "--total-frames", "1200",
                      "--eval-episodes", "0")),
}
COLLECTORS = ("asyncpool", "torchrl")
#: the scripts that can end their run at the target (``--stop-at-target true``)
_STOPS_AT_TARGET = ("ppo_mujoco", "sac_mujoco")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scripts", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    p.add_argument("--collectors", nargs="+", choices=COLLECTORS, default=list(COLLECTORS))
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="seeds of every script (default: 0 and 1 for the MuJoCo scripts, 0 for Pong)")
    p.add_argument("--quick", action="store_true", help="a few thousand frames per run: the pipeline, not the speed")
    p.add_argument("--total-frames", type=int, default=None, help="cap every run at this many frames")
    p.add_argument("--stop-at-target", action="store_true",
                   help="end each PPO and SAC run when its mean return reaches the target (the time to the target is "
                        "the comparison; the rest of the curve is not drawn)")
    p.add_argument("--script-args", default="",
                   help="more flags for every run's script, as one string (e.g. \"--init-random-frames 5000\"); "
                        "they come last, so they win over --quick's and --total-frames")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds one run may take (default: 900 with --quick, none otherwise)")
    p.add_argument("--log-dir", default=None, help="where the runs log (default: a temporary directory)")
    p.add_argument("--out", default=str(HERE / "results_training.json"), help="the JSON; the PNG goes next to it")
    args = p.parse_args(argv)
    if args.total_frames is not None and args.total_frames < 1:
        p.error(f"--total-frames must be >= 1, got {args.total_frames}.")
    if args.timeout is None and args.quick:
        args.timeout = 900.0
    return args


def read_scalar(run_dir: Path, name: str) -> dict[int, float]:
    """``{step: value}`` of one CSVLogger scalar (``{}`` when the run never logged it)."""
    path = run_dir / "scalars" / f"{name}.csv"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().split():
        step, value = line.split(",")[:2]
        out[int(float(step))] = float(value)
    return out


def read_curve(run_dir: Path) -> list[dict]:
    """One point per logged iteration: ``frames``, ``time_s`` and ``mean_return`` (``None`` while
    no episode has ended)."""
    times, returns = read_scalar(run_dir, "time_s"), read_scalar(run_dir, "mean_return")
    curve = []
    for step in sorted(times):
        ret = returns.get(step)
        curve.append({"frames": step, "time_s": times[step],
                      "mean_return": None if ret is None or math.isnan(ret) else ret})
    return curve


def first_reach(curve: list[dict], target: float | None) -> dict | None:
    """The first point at which the mean return reached ``target``."""
    if target is None:
        return None
    for point in curve:
        if point["mean_return"] is not None and point["mean_return"] >= target:
            return {"frames": point["frames"], "time_s": point["time_s"]}
    return None


def command(script: str, collector: str, seed: int, log_dir: Path, args) -> list[str]:
    cmd = [sys.executable, str(SCRIPTS / f"{script}.py"), "--collector", collector, "--seed", str(seed),
           "--log-dir", str(log_dir), "--exp-name", f"{script}_{collector}_seed{seed}", "--progress", "false"]
    if args.quick:
        cmd += RUNS[script][2]
    if args.total_frames is not None:
        cmd += ["--total-frames", str(args.total_frames)]  # the last one given wins (argparse)
    if args.stop_at_target and script in _STOPS_AT_TARGET:
        cmd += ["--stop-at-target", "true"]
    return cmd + shlex.split(args.script_args)


def run_one(script: str, collector: str, seed: int, log_dir: Path, args) -> dict:
    """One training run in its own process; its curve read back from its CSV logs."""
    cmd = command(script, collector, seed, log_dir, args)
    print(f"-- {script} --collector {collector} --seed {seed}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = None, f"timed out after {exc.timeout} s"
    wall_s = time.monotonic() - t0
    curve = read_curve(log_dir / f"{script}_{collector}_seed{seed}")
    reached = first_reach(curve, RUNS[script][1])
    last = curve[-1] if curve else {}
    print(f"   exit {rc}, {wall_s:.0f} s, {last.get('frames', 0)} frames, mean return {last.get('mean_return')}"
          + (f", target reached at {reached['time_s']:.0f} s" if reached else ""), flush=True)
    if rc != 0:
        print(tail, file=sys.stderr)
    return {"script": script, "collector": collector, "seed": seed, "command": cmd[1:], "returncode": rc,
            "wall_s": wall_s, "target": RUNS[script][1], "reached": reached, "curve": curve,
            **({} if rc == 0 else {"output_tail": tail})}


def ratios(runs: list[dict]) -> list[dict]:
    """Per script and seed: asyncpool's seconds to the target over torchrl's (both must reach it)."""
    out = []
    for script in dict.fromkeys(r["script"] for r in runs):
        for seed in dict.fromkeys(r["seed"] for r in runs if r["script"] == script):
            pair = {r["collector"]: r for r in runs if r["script"] == script and r["seed"] == seed}
            ours, theirs = pair.get("asyncpool"), pair.get("torchrl")
            if ours and theirs and ours["reached"] and theirs["reached"]:
                out.append({"script": script, "seed": seed,
                            "time_to_target_ratio": ours["reached"]["time_s"] / theirs["reached"]["time_s"]})
    return out


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Return against wall-clock and against frames, one row per script."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scripts = list(dict.fromkeys(r["script"] for r in runs))
    fig, axes = plt.subplots(len(scripts), 2, figsize=(11, 3.6 * len(scripts)), squeeze=False)
    colors = {"asyncpool": "tab:blue", "torchrl": "tab:orange"}
    for row, script in zip(axes, scripts):
        for r in (r for r in runs if r["script"] == script):
            points = [p for p in r["curve"] if p["mean_return"] is not None]
            style = dict(color=colors[r["collector"]], ls=("-", "--", ":")[r["seed"] % 3], lw=1.5, marker=".",
                         label=f"{r['collector']}, seed {r['seed']}")
            row[0].plot([p["time_s"] for p in points], [p["mean_return"] for p in points], **style)
            row[1].plot([p["frames"] for p in points], [p["mean_return"] for p in points], **style)
        target = RUNS[script][1]
        for ax, xlabel in zip(row, ("wall-clock (s)", "frames")):
            if target is not None:
                ax.axhline(target, color="k", ls="--", lw=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("mean training return")
            ax.set_title(script)
            ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - outside a git checkout
        return None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "torchrl", "tensordict", "gymnasium", "mujoco", "ale-py"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"commit": _git("rev-parse", "HEAD"), "commit_dirty": bool(_git("status", "--porcelain")),
            "date_utc": now.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "total_frames": args.total_frames,
            "script_args": args.script_args,
            "cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "versions": _versions()}
    runs = []
    with tempfile.TemporaryDirectory(prefix="compare_training_") as tmp:
        log_dir = Path(args.log_dir or tmp)
        for script in args.scripts:
            for seed in args.seeds if args.seeds is not None else RUNS[script][0]:
                for collector in args.collectors:  # the two collectors of one seed back to back
                    runs.append(run_one(script, collector, seed, log_dir, args))
    meta["date_end_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    result = {**meta, "ratios": ratios(runs), "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = out.with_suffix(".png")
    commit = (meta["commit"] or "?")[:7] + (" + changes" if meta["commit_dirty"] else "")
    plot(runs, png, f"AsyncPoolCollector vs TorchRL's collectors, commit {commit}, {meta['date_utc']} UTC"
         + (" (--quick)" if args.quick else ""))
    print(f"Wrote {out} and {png}")
    failed = [r for r in runs if r["returncode"] != 0]
    if failed:
        print(f"{len(failed)} run(s) failed: " + ", ".join(f"{r['script']}/{r['collector']}/seed {r['seed']}"
                                                          for r in failed), file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(1 if any(r["returncode"] != 0 for r in main()["runs"]) else 0)
