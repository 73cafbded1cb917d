"""The package's shape: layers that import only downwards, no import cycles, wandb in one module.

Data flows one way: writer -> store -> sync -> wandb. Read from the source
(module-level imports, not those made only for type checking), so a new
import that breaks a layer fails here, not in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "walbuf"

# What each layer may import from walbuf (besides itself, errors and record).
LAYERS = {
    "walbuf.store": {"walbuf.store"},
    "walbuf.directory": {"walbuf.store", "walbuf.directory", "walbuf.expiry"},
    "walbuf.buffer": {"walbuf.store", "walbuf.directory"},
    "walbuf.settings": {"walbuf.store", "walbuf.buffer"},
    # The sync knows no buffer kind: what a kind hands it is walbuf.store.source's.
    "walbuf.syncer": {"walbuf.store", "walbuf.buffer", "walbuf.syncer"},
    "walbuf.ops": {"walbuf.store", "walbuf.directory", "walbuf.buffer", "walbuf.ops"},
    "walbuf.expiry": set(),
    "walbuf.writer": {"walbuf.store", "walbuf.buffer", "walbuf.settings", "walbuf.expiry"},
}
ANYWHERE = {"walbuf.errors", "walbuf.arguments", "walbuf.record", "walbuf.histogram", "walbuf.image"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def resolve(importer: str, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path) -> set[str]:
    """The walbuf modules a module imports when it is imported (not under TYPE_CHECKING, not in functions)."""
    name = module_name(path)
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("walbuf")}
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, node.level, node.module) if node.level else (node.module or "")
            if not target.startswith("walbuf"):
                continue
            for alias in node.names:  # `from . import x` may name a module
                sub = f"{target}.{alias.name}"
                found.add(
                    sub
                    if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or is_package(sub)
                    else target
                )
    return found - {name}


GRAPH = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def test_there_is_no_import_cycle():
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(GRAPH.get(node, ())):
            if state.get(dep) == "open":
                cycle = path[path.index(dep) :] + [dep] if dep in path else [node, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    allowed = LAYERS[layer] | ANYWHERE | {layer}
    for module, deps in GRAPH.items():
        if module == layer or module.startswith(layer + "."):
            wrong = {d for d in deps if not any(d == a or d.startswith(a + ".") for a in allowed)}
            assert not wrong, f"{module} imports {sorted(wrong)}, above its layer"


def test_only_the_wandb_adapter_imports_wandb():
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n == "wandb" or n.startswith("wandb.") for n in names):
                importers.append(module_name(path))
    assert importers and all(m.startswith("walbuf.syncer.wandb.") for m in importers), sorted(set(importers))


def test_every_package_of_walbuf_is_installed():
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(init.parent / "__init__.py") for init in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_a_contributor_makes_the_next_revision_with_alembic_from_the_checkouts_root(tmp_path):
    import shutil
    import subprocess
    import sys

    root = PACKAGE.parent
    shutil.copy(root / "alembic.ini", tmp_path)
    shutil.copytree(root / "migrations", tmp_path / "migrations", ignore=shutil.ignore_patterns("__pycache__"))
    alembic = [sys.executable, "-m", "alembic", "-c", str(tmp_path / "alembic.ini")]
    made = subprocess.run([*alembic, "revision", "--rev-id", "9999", "-m", "a probe"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    (revision,) = (tmp_path / "migrations" / "versions").glob("9999_*.py")
    assert revision.name == "9999_a_probe.py"
    heads = subprocess.run([*alembic, "heads"], capture_output=True, text=True)
    assert heads.stdout.split()[0] == "9999", heads.stderr


def test_a_database_kind_that_lacks_a_method_every_kind_needs_cannot_be_made():
    from walbuf.store.backend import Backend
    from walbuf.store.sqlite import SQLiteBackend

    # Everything of a real kind but the size of its buffer.
    methods = {name: getattr(SQLiteBackend, name) for name in Backend.__abstractmethods__ if name != "size"}
    without_size = type("WithoutSize", (Backend,), methods)
    with pytest.raises(TypeError, match="size"):
        without_size()
