"""Mutation testing: break one line of a module at a time and see whether the tests notice.

Each mutant changes one operator or constant of MODULE (a comparison flipped
or loosened, `and`/`or` swapped, a `not` dropped, True/False swapped, an
int moved by one); the tests then run against a copy of the tree holding
the mutant, and a mutant they fail on is "killed". Printed: each surviving
mutant (line and change), then the score (killed / all). The tree itself is
never changed.

    python scripts/mutate.py walbuf/syncer/plan.py [--tests "tests/test_upload.py"] [--timeout 300]

--tests is what pytest gets (default: the quick loop, -m "not slow" -n auto).
docs/testing.md records the scores per core module.
"""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Mutant:
    index: int  # which of the module's mutable nodes (in ast.walk order) it changes
    line: int
    change: str


def _mutable(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """The nodes a mutant can change, each with what the change is, in ast.walk order.

    Ints only 0 and 1 (off-by-one spots): moving a tuning constant (a batch
    size, say) by one changes nothing a test could see.
    """
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAPS:
            old = type(node.ops[0])
            found.append((node, f"{old.__name__} -> {_COMPARE_SWAPS[old].__name__}"))
        elif isinstance(node, ast.BoolOp):
            found.append((node, "and -> or" if isinstance(node.op, ast.And) else "or -> and"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            found.append((node, "not dropped"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            found.append((node, f"{node.value} -> {not node.value}"))
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in (0, 1):
            found.append((node, f"{node.value} -> {node.value + 1}"))
    return found


def mutants(source: str) -> list[Mutant]:
    found = _mutable(ast.parse(source))
    return [Mutant(i, getattr(node, "lineno", 0), change) for i, (node, change) in enumerate(found)]


def mutated(source: str, mutant: Mutant) -> str:
    """``source`` with ``mutant``'s change (comments and layout are lost: the code is what counts)."""
    tree = ast.parse(source)
    target, _ = _mutable(tree)[mutant.index]

    class Apply(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            node = self.generic_visit(node)
            if node is not target:
                return node
            if isinstance(node, ast.Compare):
                node.ops = [_COMPARE_SWAPS[type(node.ops[0])]()]
            elif isinstance(node, ast.BoolOp):
                node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            elif isinstance(node, ast.UnaryOp):
                return node.operand
            elif isinstance(node, ast.Constant):
                node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
            return node

    return ast.unparse(ast.fix_missing_locations(Apply().visit(tree)))


def _pytest(tree_copy: Path, tests: list[str], timeout: float | None) -> int | None:
    """pytest's exit status in ``tree_copy`` (its walbuf imported first); None if it ran past ``timeout``."""
    env = {**os.environ, "PYTHONPATH": str(tree_copy), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        return subprocess.run(command, cwd=tree_copy, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", type=Path)
    parser.add_argument("--tests", default='-m "not slow" -n auto', help="pytest's arguments (default: the quick loop)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one test run may take")
    args = parser.parse_args()
    module = args.module.resolve().relative_to(ROOT)
    source = (ROOT / module).read_text()
    found = mutants(source)
    tests = shlex.split(args.tests)
    survivors = []
    with tempfile.TemporaryDirectory(prefix="walbuf-mutate-") as tmp:
        copy = Path(tmp)
        for part in ("walbuf", "migrations", "tests", "scripts", "docs"):
            shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        for part in ("pyproject.toml", "README.md", "alembic.ini"):
            shutil.copy(ROOT / part, copy / part)
        if _pytest(copy, tests, None) != 0:
            sys.exit("the tests fail with no mutant: fix them first")
        for mutant in found:
            (copy / module).write_text(mutated(source, mutant))
            survived = _pytest(copy, tests, args.timeout) == 0  # a run that hangs noticed the mutant too
            (copy / module).write_text(source)
            print(f"{'SURVIVED' if survived else 'killed  '} {module}:{mutant.line}: {mutant.change}", flush=True)
            if survived:
                survivors.append(mutant)
    killed = len(found) - len(survivors)
    print(f"\n{module}: {killed} of {len(found)} mutants killed ({killed / max(1, len(found)):.0%}) by {args.tests}")


if __name__ == "__main__":
    main()
