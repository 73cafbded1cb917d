"""Print docs/cli.md, the CLI reference, from the commands' own help texts.

    python scripts/cli_reference.py > docs/cli.md

tests/test_cli_reference.py fails when docs/cli.md is not what this prints:
change a command's help, then run this again.
"""

from __future__ import annotations

import click

from walbuf.cli import cron, main

HEADER = """# CLI reference

Generated from the commands' own `--help` by `python scripts/cli_reference.py > docs/cli.md`;
tests/test_cli_reference.py keeps it current. README shows the two commands a new user runs.
"""


def _help(command: click.Command, name: str, parent: click.Context | None = None) -> str:
    context = click.Context(command, info_name=name, parent=parent, terminal_width=100, max_content_width=100)
    return command.get_help(context)


def reference() -> str:
    """The whole reference, as Markdown."""
    parts = [HEADER]
    root = click.Context(main, info_name="walbuf", terminal_width=100, max_content_width=100)
    parts.append(f"## walbuf\n\n```\n{_help(main, 'walbuf')}\n```\n")
    assert isinstance(main, click.Group)
    for name in main.list_commands(root):
        command = main.get_command(root, name)
        assert command is not None
        parts.append(f"## walbuf {name}\n\n```\n{_help(command, name, root)}\n```\n")
    parts.append(f"## walbuf-cron\n\n```\n{_help(cron, 'walbuf-cron')}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
