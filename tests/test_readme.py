"""README is a user's page: short, and its first five minutes run as pasted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import rows_of

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block under README's heading ``section``, in order."""
    text = README.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)


def test_readme_is_a_page_of_at_most_200_lines():
    assert README.read_text().count("\n") <= 200


@pytest.mark.slow
def test_the_first_five_minutes_run_as_pasted_and_arrive_in_one_w_and_b_run(server, tmp_path):
    env = {**os.environ, **server.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("WALBUF_BUFFER", None)
    (python, logging), (sh, syncing) = blocks("The first five minutes")[:2]
    assert (python, sh) == ("python", "sh")
    proc = subprocess.run([sys.executable, "-c", logging], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "eval-3 0 {'eval/accuracy': 0.91}" in proc.stdout
    for line in syncing.splitlines():
        proc = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"{line}: {proc.stderr}"
    (run,) = server.runs.values()
    assert run.project == "my-project"
    assert [step for step, _ in rows_of(run, "eval-3", axis="eval_step")] == [0, 12, 13]
    assert rows_of(run, "evaluate", axis="eval_step") == [(0, {"eval/accuracy": 0.9})]
    assert run.config["lr"] == {"value": 3e-4}  # as W&B stores a config value


def test_readme_gives_the_two_commands_ci_runs():
    """A newcomer finds in README itself how to set up and how to run the tests, as CI does them."""
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    setup = next(line for line in ci if "pip install" in line)
    tests = next(line for line in ci if "pytest" in line)
    commands = [line for _, code in blocks("Install") for line in code.splitlines()]
    assert setup in commands
    assert tests in commands


def test_every_relative_link_of_the_docs_leads_to_a_file_of_the_checkout():
    root = README.parent
    pages = [README, root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)}: {target}")
    assert broken == []


def test_readme_says_how_many_options_sync_has():
    from walbuf.cli import main

    options = [p for p in main.commands["sync"].params if p.param_type_name == "option"]
    line = next(line for line in README.read_text().splitlines() if line.startswith("walbuf sync BUFFER"))
    assert f"# {len(options)} options: --help" in line
