"""The layering docs/ARCHITECTURE.md states, checked on every import of the package: the
frontend never imports worker code, the worker nothing of the frontend or the engine-core,
the engine-core worker code only where it starts its workers, and the wire protocol nothing
of any of them. The benchmarks load their null model through the model registry, by name."""

from __future__ import annotations

import ast
import pathlib

import minivllm

PACKAGE = pathlib.Path(minivllm.__file__).parent
# package -> the packages it must not import, and the files that may all the same
RULES = {
    "frontend": ({"worker"}, set()),
    "worker": ({"frontend", "engine_core", "benchmarks"}, set()),
    "engine_core": (
        {"frontend", "benchmarks", "worker"},
        {"executor.py", "multiproc_executor.py", "ray_executor.py"},
    ),
    "protocol": ({"frontend", "engine_core", "worker", "benchmarks"}, set()),
    "benchmarks": ({"worker", "engine_core"}, set()),
}


def _imported_packages(path: pathlib.Path) -> set[str]:
    """The minivllm sub-packages that `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n.split(".")[1] for n in names if n.startswith("minivllm.")}


def test_each_package_imports_only_what_the_layering_allows() -> None:
    broken = []
    for package, (forbidden, exempt) in RULES.items():
        for path in sorted((PACKAGE / package).rglob("*.py")):
            if path.name not in exempt:
                for target in sorted(_imported_packages(path) & forbidden):
                    broken.append(f"{path.relative_to(PACKAGE.parent)} imports minivllm.{target}")
    assert broken == []
