"""Imports go only down the layers: frontend (entrypoints) -> engine -> core -> worker ->
model code -> config and platforms. A module's imports of pagellm (at module level or in a
function; `if TYPE_CHECKING:` blocks excepted, they never run) may name its own layer or
a lower one."""

from __future__ import annotations

import ast
from pathlib import Path

import pagellm

LAYERS = [
    # 0: leaves every layer shares
    {"envs", "logger", "utils", "sampling_params", "pooling_params", "outputs", "inputs",
     "scheduler_output", "streaming_text"},
    {"platforms", "kernels", "config"},
    {"reasoning", "structured_output"},
    {"model_executor", "attention", "sample", "spec_decode"},
    {"worker"},
    {"core"},
    {"engine", "metrics", "distributed"},
    {"entrypoints"},
    {"benchmarks", "__main__", "__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
ROOT = Path(pagellm.__file__).parent


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "pagellm":  # from pagellm import x
            out += [(node.lineno, f"pagellm.{alias.name}") for alias in node.names
                    if (ROOT / alias.name).is_dir() or (ROOT / f"{alias.name}.py").exists()]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return [(line, m) for line, m in out if m.startswith("pagellm.")]


def test_every_package_has_a_layer() -> None:
    tops = {p.name.removesuffix(".py") for p in ROOT.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert tops - RANK.keys() == set()


def test_imports_go_only_down() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        top = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for line, module in _imports(ast.parse(path.read_text())):
            target = module.split(".")[1]
            if RANK[target] > RANK[top]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line}: {top} imports {module}")
    assert upward == []
