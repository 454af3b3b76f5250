"""Every Python code block of ``README.md`` and ``docs/source/*.rst`` runs verbatim.

A block is a ```` ```python ```` fence in the README or a ``.. code-block:: python`` directive
in the docs. Each block runs on its own, as a reader would paste it into a file and run it
(``runpy.run_path(..., run_name="__main__")``, in a temporary directory of its own); all
blocks share one interpreter, so torch and TorchRL are imported once. A failing block is
reported with its page and line. A block that needs an optional extra that is not installed
(envpool, ray) is skipped, except in CI (``CI`` set), which installs them.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "source").glob("*.rst"))]

_RUNNER = r'''
import json, os, runpy, sys, tempfile, traceback
blocks = json.load(sys.stdin)
failures = []
for i, (where, code) in enumerate(blocks):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"block{i}.py")
        with open(path, "w") as f:
            f.write(code)
        cwd = os.getcwd()
        os.chdir(d)
        try:
            runpy.run_path(path, run_name="__main__")
        except ModuleNotFoundError as exc:
            # a block for an optional extra (envpool, ray) is skipped where it is not installed,
            # never in CI, which installs them
            if exc.name not in ("envpool", "ray") or os.environ.get("CI"):
                failures.append(f"{where}:\n{code}\n{traceback.format_exc()}")
        except BaseException:
            failures.append(f"{where}:\n{code}\n{traceback.format_exc()}")
        finally:
            os.chdir(cwd)
print("FAILURES-JSON " + json.dumps(failures))
'''


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """``[(page:line, code)]`` for each Python block of ``page``, in order."""
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if page.suffix == ".md" and line.strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            blocks.append((f"{page.relative_to(ROOT)}:{i + 2}", "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        elif page.suffix == ".rst" and re.fullmatch(r"\s*\.\. code-block:: python3?\s*", line):
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and lines[j].lstrip().startswith(":"):  # directive options
                j += 1
            body = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                body.append(lines[j])
                j += 1
            blocks.append((f"{page.relative_to(ROOT)}:{i + 1}", textwrap.dedent("\n".join(body)).strip() + "\n"))
            i = j - 1
        i += 1
    return blocks


def test_the_block_finder_finds_blocks_of_both_kinds():
    found = {page.name: python_blocks(page) for page in PAGES}
    assert found["README.md"], "README.md has no Python block"
    assert found["quickstart.rst"], "quickstart.rst has no Python block"
    assert all(code.strip() for blocks in found.values() for _, code in blocks)


@pytest.fixture(scope="module")
def block_failures():
    """Runs every block of every page in one interpreter (torch and TorchRL imported once);
    returns the failure reports, each starting with its ``page:line``."""
    blocks = [block for page in PAGES for block in python_blocks(page)]
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("FAILURES-JSON ")]
    assert proc.returncode == 0 and marker, f"the runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(marker[-1][len("FAILURES-JSON "):])


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run_verbatim(page, block_failures):
    where = f"{page.relative_to(ROOT)}:"
    failures = [f for f in block_failures if f.startswith(where)]
    assert not failures, "\n\n".join(failures)


_LITERAL_PYTHON = re.compile(r"^(import |from \S+ import |class |def |for |with |\w+ = )")


@pytest.mark.parametrize("page", [p for p in PAGES if p.suffix == ".rst"], ids=lambda p: p.name)
def test_python_is_not_hidden_in_literal_blocks(page):
    """A ``::`` literal block is not run; Python in one must be a ``.. code-block:: python``."""
    lines = page.read_text().splitlines()
    hidden = []
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            first = next((nxt.strip() for nxt in lines[i + 1:i + 4] if nxt.strip()), "")
            if _LITERAL_PYTHON.match(first):
                hidden.append(f"{page.name}:{i + 1}: {first}")
    assert not hidden, "Python in literal blocks (write them as '.. code-block:: python'):\n" + "\n".join(hidden)


_RST_DIRECTIVE = re.compile(r"^\s*\.\. (code-block|code|sourcecode|testcode|doctest|ipython)::\s*(\S*)")
_NOT_PYTHON = {"bash", "console", "text", "shell", "sh", "none"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_is_found_or_not_python(page):
    """The runner above finds ```` ```python ```` fences and ``.. code-block:: python``; Python
    written any other way (```` ```py ````, ``.. code:: python``, ``.. doctest::``, a ``>>>``
    prompt outside a block it runs) would never run in CI. Other blocks must name a language
    that is not Python."""
    lines = page.read_text().splitlines()
    unrun = []
    for i, line in enumerate(lines):
        if page.suffix == ".md" and line.strip().startswith("```") and line.strip() != "```":
            language = line.strip()[3:].strip()
            if language != "python" and language not in _NOT_PYTHON:
                unrun.append(f"{page.name}:{i + 1}: {line.strip()}")
        elif page.suffix == ".rst":
            m = _RST_DIRECTIVE.match(line)
            run_or_not_python = m and m.group(1) == "code-block" and m.group(2) in ("python", "python3", *_NOT_PYTHON)
            if m and not run_or_not_python:
                unrun.append(f"{page.name}:{i + 1}: {line.strip()}")
            if line.lstrip().startswith(">>>"):
                unrun.append(f"{page.name}:{i + 1}: {line.strip()}")
    found = len(python_blocks(page))
    fences = sum(line.strip() == "```python" for line in lines) if page.suffix == ".md" else sum(
        bool(re.fullmatch(r"\s*\.\. code-block:: python3?\s*", line)) for line in lines)
    assert found == fences, f"{page.name}: {fences} Python blocks, {found} found by the runner"
    assert not unrun, "Python blocks CI would not run (write them as '.. code-block:: python' / '```python'):\n" + \
        "\n".join(unrun)
