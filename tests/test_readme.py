"""The README opens with the two set-up commands, and CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "pdserve" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert readme_commands()[1] == ci[-1]
