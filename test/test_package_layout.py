"""The tree shows the architecture: packages in layers, imports pointing down them, no import
circles, no private name imported from another package, nothing loose at the top level."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "torchrl_asyncpool"
#: bottom to top: a package may import the ones before it, never one after it
LAYERS = ["errors", "step_type", "_sys", "exchange", "testing", "delivery", "envs", "workers", "inference", "pool",
          "collector", "remote", "evaluation", "examples", "cli"]


def _modules() -> dict:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(mods: dict) -> dict:
    """``{module: [(imported module, imported name or None)]}`` within the package, function-level imports too."""
    edges = {}
    for name, path in mods.items():
        out = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchrl_asyncpool"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    out.append((full, None) if full in mods else (node.module, alias.name))
            elif isinstance(node, ast.Import):
                out += [(a.name, None) for a in node.names if a.name.startswith("torchrl_asyncpool")]
        edges[name] = out
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_top_level_holds_packages_errors_and_step_types_only():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "errors.py", "step_type.py"], loose
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert set(packages) <= set(LAYERS), set(packages) - set(LAYERS)
    for package in packages:  # each says what it owns
        assert ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())), package


def test_imports_point_down_the_layers_and_never_at_another_packages_private_names():
    edges = _imports(_modules())
    wrong = []
    for module, targets in edges.items():
        here = _package(module)
        for target, name in targets:
            there = _package(target)
            if not here or not there or here == there:
                continue
            if LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{module} imports {target} (a higher layer)")
            if name is not None and name.startswith("_") and not name.startswith("__"):
                wrong.append(f"{module} imports the private {target}.{name}")
            if any(part.startswith("_") and part != "_sys" for part in target.split(".")[1:]):
                wrong.append(f"{module} imports the private module {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    edges = _imports(_modules())
    graph = {m: {t for t, _ in ts if not t.startswith(m + ".") and t != m} for m, ts in edges.items()}
    cycles, state, stack = [], {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in graph.get(u, ()):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif not state.get(v):
                visit(v)
        stack.pop()
        state[u] = 2

    for module in graph:
        if not state.get(module):
            visit(module)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
