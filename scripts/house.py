"""The shape of the walbuf package at a commit: its rooms, the arrows between them, its largest files and functions.

A room is a module of walbuf (a .py file); an arrow is one module importing
another of walbuf (counted once per pair); a function's size is its lines,
decorators and docstring included. Read from git, so any commit can be
measured without checking it out:

    python scripts/house.py [COMMIT ...]   (default: HEAD)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import PurePosixPath


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def _module(path: str) -> str:
    parts = list(PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The walbuf modules ``module`` imports (a name from a package counts as the package, or its submodule)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("walbuf"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                target = ".".join([*stem, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.startswith("walbuf"):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def measure(commit: str) -> None:
    files = [f for f in _git("ls-tree", "-r", "--name-only", commit, "walbuf").split() if f.endswith(".py")]
    sources = {f: _git("show", f"{commit}:{f}") for f in files}
    modules = {_module(f): f for f in files}
    arrows: set[tuple[str, str]] = set()
    functions: list[tuple[int, str]] = []
    for module, path in modules.items():
        tree = ast.parse(sources[path])
        for target in _imported(tree, module, path.endswith("__init__.py")):
            if target in modules and target != module:
                arrows.add((module, target))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                functions.append((node.end_lineno - start + 1, f"{module}.{node.name}"))
    sizes = sorted(((len(sources[p].splitlines()), p) for p in files), reverse=True)
    short = _git("rev-parse", "--short", commit).strip()
    print(f"{short}: {len(modules)} rooms, {len(arrows)} arrows, {sum(n for n, _ in sizes):,} lines")
    print("  largest files: " + ", ".join(f"{p.removeprefix('walbuf/')} {n}" for n, p in sizes[:5]))
    top = sorted(functions, reverse=True)[:5]
    print("  largest functions: " + ", ".join(f"{name.removeprefix('walbuf.')} {n}" for n, name in top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="*", default=["HEAD"])
    for commit in parser.parse_args().commits:
        measure(commit)


if __name__ == "__main__":
    main()
