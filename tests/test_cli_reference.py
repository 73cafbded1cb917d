"""docs/cli.md is the commands' own help, as scripts/cli_reference.py prints it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_the_cli_reference_in_docs_is_what_the_commands_help_says():
    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cli_reference.py")], capture_output=True, text=True, check=True
    ).stdout
    assert printed == (ROOT / "docs" / "cli.md").read_text(), (
        "docs/cli.md is out of date: run python scripts/cli_reference.py > docs/cli.md"
    )
