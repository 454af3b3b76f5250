"""``torchrl-asyncpool bench``: the repository's side-by-side collector benchmark
(``benchmarks/compare_collectors.py``) from a source checkout."""
from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

from torchrl_asyncpool.cli._common import _start_fork_server


def _default_benchmark() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks" / "compare_collectors.py"


#: the plot the default benchmark script writes when matplotlib is installed and --plot is not given
_DEFAULT_PLOT = "compare_collectors.png"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        return False
    return True


def _plot_arguments(extra: list, args: argparse.Namespace) -> list:
    """The script's arguments ``extra`` with the plot settled.

    The default script gets ``--plot compare_collectors.png`` when no plot is named (``--plot``
    here or after ``--``) and matplotlib is installed; without matplotlib that default plot is
    skipped with a one-line notice and the benchmark runs. A plot named explicitly without
    matplotlib raises ``ImportError`` naming the extra to install (before anything runs).
    """
    helping = "-h" in extra or "--help" in extra
    asked = next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--plot"), None)
    asked = next((a.split("=", 1)[1] for a in extra if a.startswith("--plot=")), asked)
    if asked is None and args.script is None:
        if args.plot is None and not helping:  # the default plot, only where it can be drawn
            if _has_matplotlib():
                return extra + ["--plot", _DEFAULT_PLOT]
            print("torchrl-asyncpool bench: matplotlib is not installed: no plot (pip install "
                  "'torchrl-asyncpool[benchmarks]' for one).", file=sys.stderr)
            return extra
        if args.plot:
            asked, extra = args.plot, extra + ["--plot", args.plot]
    if asked and not helping and not _has_matplotlib():
        raise ImportError(f"the plot {asked!r} needs matplotlib, which is not installed: pip install "
                          "'torchrl-asyncpool[benchmarks]' (or --plot '' for no plot).")
    return extra


def _cmd_bench(args: argparse.Namespace) -> int:
    script = Path(args.script) if args.script else _default_benchmark()
    if not script.is_file():
        print(
            f"torchrl-asyncpool bench: the benchmark script {script} was not found.\n"
            "It ships with the source repository, not with the installed package: run this command "
            "from an editable install of a clone (pip install -e .), or pass --script PATH.",
            file=sys.stderr,
        )
        return 2
    extra = list(args.bench_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        extra = _plot_arguments(extra, args)
    except ImportError as exc:
        print(f"torchrl-asyncpool bench: {exc}", file=sys.stderr)
        return 2
    if args.script is None:
        _start_fork_server()
    print(f"Running {script} {' '.join(extra)}".rstrip(), flush=True)
    # run it as `python SCRIPT ARGS` would: its folder first on sys.path, its own argv
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *extra]
    sys.path.insert(0, str(script.resolve().parent))
    t0 = time.monotonic()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # the script's own exit status
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:  # the script's own cleanup (its finally blocks) has run
        print(f"\ntorchrl-asyncpool bench: interrupted after {time.monotonic() - t0:.1f} s; the rows printed "
              "above are complete, no plot or JSON was written.", file=sys.stderr)
        return 130
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return 0



def add_parser(sub) -> None:
    """Registers the command and its options on the ``torchrl-asyncpool`` subparsers ``sub``."""
    bench = sub.add_parser(
        "bench", help="run the side-by-side benchmark against TorchRL's stock collector",
        description="Run benchmarks/compare_collectors.py from the source checkout (AsyncPoolCollector vs "
                    "TorchRL's stock collectors): prints the table and writes a PNG plot. Other arguments "
                    "are passed to the script, e.g. 'torchrl-asyncpool bench --quick'; "
                    "'torchrl-asyncpool bench -- --help' lists them.",
    )
    bench.add_argument("--script", default=None, help=f"benchmark script (default: {_default_benchmark()})")
    bench.add_argument("--plot", default=None,
                       help="PNG plot written by the default benchmark script ('' for none; default: "
                            f"{_DEFAULT_PLOT} when matplotlib is installed, else no plot and a notice); needs "
                            "matplotlib: pip install 'torchrl-asyncpool[benchmarks]'")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    bench.set_defaults(func=_cmd_bench)
