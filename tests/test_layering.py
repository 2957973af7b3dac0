"""The package's layers import only downward, and serving never loads the tuner or the benchmark.

Layers, from the bottom: the runtime (everything not named below: specs, codegen, planning, the
tuned tables, `DecodeAttention`), `splitkv.timing` (events, L2 flush, copy bandwidth, read floor),
`splitkv.bench` (the benchmark), `splitkv.autotune` (the offline tuner, whose report compares the
tuned programs with the benchmark's peers), `splitkv.cli` (`splitkv-gen`, which drives them all).
Every ``import`` and ``from ... import`` statement counts, inside functions too: a lazy import is
an import all the same once its function runs.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "splitkv"

#: Layers by rank: a module may import its own layer and those of lower rank only.
LAYERS = (("runtime", 0), ("splitkv.timing", 1), ("splitkv.bench", 2), ("splitkv.autotune", 3), ("splitkv.cli", 4))
#: The benchmark's entry points: the tuner runs the benchmark's parts, never its command line.
BENCH_CLI = ("splitkv.bench.cli", "splitkv.bench.__main__")
#: The one tuner module that runs the benchmark (its peers and protocol): the report's bandwidth
#: sweep. The tuner's own timing comes from splitkv.timing.
TUNER_BENCH_USERS = {"splitkv.autotune.sweep"}


def _module_name(path: Path) -> str:
    parts = ("splitkv", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict:
    """{module name: path} of every Python module under splitkv/."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set) -> set:
    """The splitkv modules ``name`` imports anywhere in its file. ``from pkg import sub`` imports the
    submodule: the package it sits in is loaded on the way, as for every module, and is no edge."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module (or package) itself
                found.add(target)
    return {m for m in found if m == "splitkv" or m.startswith("splitkv.")}


def _graph() -> dict:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target in _imports(name, path, known):
            while target not in known:  # `import splitkv.a.b.name`: the module it names
                target = target.rpartition(".")[0]
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _rank(module: str) -> tuple[str, int]:
    for prefix, rank in LAYERS[1:]:
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    return LAYERS[0]


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _closure(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
    return seen


def test_the_graph_is_read():
    # The checks below mean something only if the parser sees the edges known to exist.
    graph = _graph()
    assert "splitkv.tuned.lookup" in graph["splitkv.runtime"]
    assert "splitkv.tuned.tables" in graph["splitkv.tuned.lookup"]  # `from . import tables`
    assert "splitkv.codegen.load" in graph["splitkv.runtime"]  # imported inside a function
    assert "splitkv.autotune.cli" in graph["splitkv.cli"]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    upward = [(m, t) for m, targets in _graph().items() for t in sorted(targets) if _rank(t)[1] > _rank(m)[1]]
    assert upward == [], "\n".join(f"{m} ({_rank(m)[0]}) imports {t} ({_rank(t)[0]})" for m, t in upward)


def test_the_tuner_times_with_the_timing_library_not_the_benchmark():
    graph = _graph()
    tuner = {m: t for m, t in graph.items() if _within(m, ["splitkv.autotune"])}
    assert not [(m, t) for m, targets in tuner.items() for t in targets if _within(t, BENCH_CLI)]
    bench_users = {m for m, targets in tuner.items() if any(_within(t, ["splitkv.bench"]) for t in targets)}
    assert bench_users <= TUNER_BENCH_USERS
    assert any(_within(t, ["splitkv.timing"]) for m in tuner for t in graph[m])


def test_serving_reaches_no_tuner_and_no_benchmark_statically():
    graph = _graph()
    reached = _closure(graph, "splitkv")
    assert "splitkv.runtime" in reached and "splitkv.tuned.lookup" in reached
    assert not [m for m in reached if _within(m, ["splitkv.autotune", "splitkv.bench", "splitkv.timing", "splitkv.cli"])]


_IMPORT_ALL = """
import importlib, json, sys
import splitkv
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_what_decode_imports_loads_no_tuner_no_benchmark_no_optuna():
    # Every module decode() can import, the lazy ones included (the static closure of `splitkv`:
    # codegen's loader, the occupancy query, the packed parameters, the paged layouts, ...),
    # imported in a fresh interpreter. Importing needs no GPU.
    reached = sorted(_closure(_graph(), "splitkv"))
    assert {"splitkv.runtime", "splitkv.codegen.load", "splitkv.tuned.lookup"} <= set(reached)
    run = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *reached], capture_output=True, text=True,
                         cwd=ROOT.parent, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.splitlines()[-1])
    assert set(reached) <= set(loaded)
    unwanted = [m for m in loaded if _within(m, ["optuna", "splitkv.autotune", "splitkv.bench", "splitkv.timing"])]
    assert unwanted == []


@pytest.mark.parametrize("edges, cyclic", [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": set()}, False),
                                           ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)])
def test_the_cycle_finder_finds_cycles(edges, cyclic):
    assert bool(_cycles(edges)) == cyclic
