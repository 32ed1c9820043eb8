"""The house's shape: stages import only earlier stages, nothing imports in a circle, `cost_models`
stands on its own, and `profiles/` is data, not an importable package. Functions stay short (60 lines,
unless a comment says why) with at most 8 parameters, and each concept has one record: one mesh, one
request, one table builder.

Imports are read from the source (every `import` and `from ... import`, inside functions and under
`if TYPE_CHECKING:` too), so a lazy import against the flow fails here as surely as a top-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]

# Layers, earliest first: a module may import its own layer and earlier ones, never a later one.
LAYERS: list[tuple[str, ...]] = [
    ("cost_models",),
    ("autoplan.version", "autoplan.errors", "autoplan.sizes", "autoplan.fileio"),
    ("autoplan.settings_flags",),
    ("autoplan.settings", "autoplan.profile_store", "autoplan.pins", "autoplan.machine"),
    ("autoplan.models",),
    ("autoplan.tracing",),
    ("autoplan.solve",),
    ("autoplan.plan",),
    ("autoplan.api", "autoplan.plots"),
    ("autoplan.run",),
    ("autoplan.profiling",),
    ("autoplan.cli",),
    ("autoplan", "autoplan.__main__"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in ("autoplan", "cost_models") for p in (REPO / package).rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (a `from package import submodule` counts as the submodule)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            submodules = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in `base` itself
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {module for module in found if module in modules and module != name}


def _layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of tests/test_layout.py: add it"
    return best[0]


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    modules = _project_modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for imported in _imports(path, name, modules):
            g.add_edge(name, imported)
    return g


def test_no_import_circles(graph):
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_no_stage_imports_a_later_one(graph):
    against = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
               for a, b in graph.edges if _layer(b) > _layer(a)]
    assert not against, "imports against the flow:\n" + "\n".join(sorted(against))


def test_cost_models_import_nothing_from_autoplan(graph):
    found = [(a, b) for a, b in graph.edges if a.startswith("cost_models") and b.startswith("autoplan")]
    assert not found


def test_no_module_is_a_hub():
    """No module over 360 lines: a module that long has grown more than one job."""
    long = {name: len(path.read_text().splitlines()) for name, path in _project_modules().items()}
    assert not {name: n for name, n in long.items() if n > 360}


def test_profiles_folder_is_data_not_a_package(tmp_path):
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not any(p == "profiles" or p.startswith("profiles.") for p in config["packages"])
    assert not (REPO / "profiles" / "__init__.py").exists()
    # from anywhere but the repository, `profiles` does not import, and the shipped profiles are found
    code = ("import importlib.util, autoplan.profile_store as s; "
            "print(importlib.util.find_spec('profiles') is None, sorted(s.available_profiles()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PATH": "", "AUTOPLAN_PROFILE_DIR": str(tmp_path / "none")})
    assert out.stdout.startswith("True ") and "'cpu-gloo-2'" in out.stdout and "'a100-sxm4-80gb'" in out.stdout


MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8
LONG_MARK = "# long:"  # a comment in a longer function saying why it is one piece
# The one exemption from the parameter cap: a function that transformers calls through one of its attention
# interfaces (AttentionInterface: query, key, value, mask, dropout, scaling and the model's own keywords) has
# transformers' parameters, not ours to gather into a record. The comment stands on the line above its `def`.
FOREIGN_SIGNATURE_MARK = "# signature: transformers' AttentionInterface"


def _functions():
    for name, path in _project_modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node, lines[node.lineno - 1:node.end_lineno]


def _foreign_signatures() -> set[str]:
    """Functions (module.name) marked as taking transformers' attention-interface signature."""
    found = set()
    for name, path in _project_modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
                if first >= 2 and lines[first - 2].strip().startswith(FOREIGN_SIGNATURE_MARK):
                    found.add(f"{name}.{node.name}")
    return found


def test_functions_are_short_or_say_why():
    long = [f"{module}.{node.name} ({len(body)} lines)" for module, node, body in _functions()
            if len(body) > MAX_FUNCTION_LINES and not any(line.strip().startswith(LONG_MARK) for line in body)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines without a `{LONG_MARK} ...` comment: {long}"


def test_no_function_takes_more_than_eight_parameters():
    wide = []
    foreign = _foreign_signatures()
    for module, node, _ in _functions():
        args = node.args
        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        names = names[1:] if names[:1] in (["self"], ["cls"]) else names
        if len(names) > MAX_PARAMETERS and f"{module}.{node.name}" not in foreign:
            wide.append(f"{module}.{node.name} ({len(names)})")
    assert not wide, f"functions with more than {MAX_PARAMETERS} parameters (take a record instead): {wide}"


def test_foreign_signatures_are_few_and_registered_with_transformers():
    """The exemption stays narrow: only functions hf_attention_hooks registers as an attention interface."""
    assert _foreign_signatures() == {"autoplan.models.hf_attention.hf_attention"}
    source = (REPO / "autoplan" / "models" / "hf_attention.py").read_text()
    assert "ALL_ATTENTION_FUNCTIONS.register(HF_IMPLEMENTATION, hf_attention)" in source


def _classes_with_field(field: str) -> set[str]:
    """Classes (module.Class) that declare `field` as an annotated attribute."""
    found = set()
    for name, path in _project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == field
                    for item in node.body):
                found.add(f"{name}.{node.name}")
    return found


def _callers(function: str) -> set[str]:
    """Modules that call `function` (by its bare name)."""
    found = set()
    for name, path in _project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if callee == function:
                    found.add(name)
    return found


def test_one_record_per_concept():
    # the mesh: one record of degrees and topology; the plan file's serialised form; the user's settings
    assert _classes_with_field("gpus_per_node") == {"cost_models.mesh.Mesh", "autoplan.plan.cluster_spec.ClusterSpec",
                                                     "autoplan.settings.PlanningSettings"}
    assert _classes_with_field("tp_degree") == {"autoplan.plan.cluster_spec.ClusterSpec"}
    # the request: one record handed below the API (no bundle of the same settings elsewhere)
    assert _classes_with_field("meshes") == {"autoplan.solve.request.PlanRequest"}
    assert _classes_with_field("limits") == {"autoplan.solve.request.PlanRequest"}
    # the table: one builder, one extrapolation, one tensor-parallel transform
    assert _callers("build_cost_table") == {"autoplan.solve.tables"}
    assert _callers("extrapolate_ops") == {"autoplan.solve.tables"}
    assert _callers("tp_ops") == {"autoplan.solve.tables"}

