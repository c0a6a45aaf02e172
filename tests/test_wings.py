"""The package's import rules, read from the source (every import, lazy ones included): each
host in its own wing (only verl/ imports verl; megatron/ and the rollout's model path import
no verl), the shared model imports only consistent_ops, and no two modules import each other
in a circle."""
import ast
from pathlib import Path

import true_on_policy

PKG = Path(true_on_policy.__file__).parent
LAUNCHER = "true_on_policy.main_ppo"      # the recipe's entry point: it runs verl's main


def _name(path):
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path):
    """Absolute names a module imports (``from . import x`` -> package.x)."""
    me, is_pkg = _name(path), path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")[:len(me.split(".")) - node.level + is_pkg]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


MODULES = {_name(p): p for p in PKG.rglob("*.py")}
GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
IMPORTS = {m: set(_imports(p)) for m, p in MODULES.items()}


def _host(names, host):
    return sorted(n for n in names if n == host or n.startswith(host + "."))


def _reach(start):
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH[m] - {p for p in GRAPH[m] if MODULES[p].name == "__init__.py" and p != m}
    return seen


def test_only_the_verl_wing_imports_verl():
    outside = {m: _host(i, "verl") for m, i in IMPORTS.items()
               if _host(i, "verl") and not m.startswith("true_on_policy.verl") and m != LAUNCHER}
    assert not outside, outside


def test_megatron_wing_and_rollout_model_path_free_of_verl():
    for start in [m for m in MODULES if m.startswith("true_on_policy.megatron")] + ["true_on_policy.vllm.model"]:
        reached = _reach(start)
        assert not [m for m in reached if m.startswith("true_on_policy.verl")], (start, reached)
        assert not [m for m in reached if _host(IMPORTS[m], "verl")], (start, reached)


def test_models_import_only_consistent_ops():
    for m in [m for m in MODULES if m.startswith("true_on_policy.models")]:
        ours = {i for i in IMPORTS[m] if i.startswith("true_on_policy") and not i.startswith("true_on_policy.models")}
        assert not ours, (m, ours)


def test_no_import_circles():
    def visit(m, path):
        for n in GRAPH[m]:
            if MODULES[n].name == "__init__.py":
                continue                         # a package's face hands names on
            assert n not in path, " -> ".join([*path[path.index(n):], n])
            visit(n, [*path, n])
    for m in MODULES:
        visit(m, [m])
