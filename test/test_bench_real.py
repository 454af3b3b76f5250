"""Smoke test of ``benchmarks/compare_real.py --quick``: the real-workload benchmark runs end to end
(Atari 16 and MuJoCo 16, our collector, the ``SyncVectorEnv`` loop and the env-only ceiling; our
collector hosting EnvPool's vector envs) and writes a JSON with every cell. Numbers are not
checked: CI machines are shared.

Runs the script in a subprocess, as a user would (its collector's fork server re-imports the main
module). About 30-60 s on 2 cores, 2-3 minutes while another job keeps one core busy.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark_script

pytest.importorskip("ale_py")
pytest.importorskip("mujoco")
pytest.importorskip("cv2")  # gymnasium's AtariPreprocessing resizes with OpenCV

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_real.py"
SYSTEMS = ["ours_gym", "gym_sync", "env_only"]


def run_quick(tmp_path, systems, envs):
    """``compare_real.py --quick`` on both workloads with the mean policy: its JSON."""
    out = tmp_path / "results_real.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--workloads", "atari", "mujoco", "--envs", str(envs),
           "--policies", "mean", "--systems", *systems, "--json", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a hang guard, not a speed bound: 2-3 minutes beside one busy loop on 2 cores
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_compare_real_quick(tmp_path):
    data = run_quick(tmp_path, SYSTEMS, 16)
    assert data["meta"]["machine"]["cores"] >= 1
    assert data["meta"]["commit"] is not None
    cells = {c["cell"]: c for c in data["cells"]}
    assert set(cells) == {"Atari 16", "MuJoCo 16"}, sorted(cells)
    for name, cell in cells.items():
        assert set(cell["systems"]) == set(SYSTEMS), (name, sorted(cell["systems"]))
        for system, entry in cell["systems"].items():
            assert "error" not in entry, (name, system, entry.get("error"))
            assert entry["median"] > 0, (name, system, entry)
            assert len(entry["fps"]) == 1  # --quick: one repeat
        ours = cell["systems"]["ours_gym"]
        assert {"gym_sync", "env_only"} <= set(ours["vs"])
        assert ours["vs_ceiling"]["ceiling"] == "env_only"
        assert ours["collector"]["pool"]["num_workers"] >= 1
    assert "| Atari 16 |" in data["table_markdown"] and "| MuJoCo 16 |" in data["table_markdown"]
    assert len(data["rows"]) == 2 * len(SYSTEMS)


def test_compare_real_hosts_envpool(tmp_path):
    """``ours_envpool`` and ``ours_envpool_async``: the collector hosting EnvPool's ``Pong-v5`` and
    ``HalfCheetah-v4`` vector envs as factories, in lockstep and in EnvPool's asynchronous mode (4
    envs: one factory of 2 per core on 2 cores)."""
    pytest.importorskip("envpool")
    data = run_quick(tmp_path, ["ours_envpool", "ours_envpool_async"], 4)
    cells = {c["cell"]: c for c in data["cells"]}
    assert set(cells) == {"Atari 4", "MuJoCo 4"}, sorted(cells)
    for name, cell in cells.items():
        for system, path in (("ours_envpool", "envpool"), ("ours_envpool_async", "envpool_async")):
            entry = cell["systems"][system]
            assert "error" not in entry, (name, system, entry.get("error"))
            assert entry["median"] > 0, (name, system, entry)
            assert entry["collector"]["pool"]["slots_" + path] == 4  # every slot stepped by that EnvPool adapter


def test_compare_real_torchrl_idiom(tmp_path):
    """``ours_torchrl_idiom`` and its ceiling: TorchRL's own Atari idiom (``GymEnv`` + ``ToTensorImage``,
    ``GrayScale``, ``Resize``, ``CatFrames``) run end to end, Atari only, set against its own stack's
    env-only ceiling; MuJoCo cells leave both out."""
    data = run_quick(tmp_path, ["ours_torchrl_idiom", "env_only_torchrl_idiom"], 4)
    cells = {c["cell"]: c for c in data["cells"]}
    atari = cells["Atari 4"]["systems"]
    assert set(atari) == {"ours_torchrl_idiom", "env_only_torchrl_idiom"}, sorted(atari)
    for system, entry in atari.items():
        assert "error" not in entry, (system, entry.get("error"))
        assert entry["median"] > 0, (system, entry)
    assert atari["ours_torchrl_idiom"]["vs_ceiling"]["ceiling"] == "env_only_torchrl_idiom"
    assert not cells.get("MuJoCo 4", {}).get("systems"), cells.get("MuJoCo 4")


def test_torchrl_idiom_frames():
    """The idiom's envs give what TorchRL's Atari recipe gives its policy: 4 stacked 84x84 grey
    frames, float32 in [0, 1], a one-hot action of Pong's 6; its resize (torchvision's tensor call,
    made without torchvision) keeps a constant image constant and maps 210x160 to 84x84."""
    import torch

    compare_real = load_benchmark_script("compare_real")
    env = compare_real.make_torchrl_idiom_atari()
    try:
        assert env.observation_spec["pixels"].shape == (4, 84, 84)
        assert env.action_spec.shape == (6,)
        td = env.rand_step(env.reset())
        pixels = td["next", "pixels"]
        assert pixels.dtype == torch.float32 and pixels.shape == (4, 84, 84)
        assert 0.0 <= pixels.min() <= pixels.max() <= 1.0 and pixels.max() > 0
    finally:
        env.close()
    resize = compare_real._interpolate_resize(84, 84)
    out = resize._apply_transform(torch.full((2, 1, 210, 160), 0.25))
    assert out.shape == (2, 1, 84, 84) and torch.allclose(out, torch.full_like(out, 0.25))
