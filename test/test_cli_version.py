"""``torchrl-asyncpool --version`` answers without importing torch (it took seconds when it did)."""
import subprocess
import sys


def test_version_names_the_exchange_without_importing_torch():
    code = ("import sys; from torchrl_asyncpool.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "exchange:" in out.stdout and "torch imported: False" in out.stdout, out.stdout + out.stderr
