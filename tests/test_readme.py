"""The README's engine example runs as printed, and the commands it shows exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcore.cli import main as kvcore_cli

README = (Path(__file__).parents[1] / "README.md").read_text()


def section(heading: str) -> str:
    return README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_engine_example_runs():
    code = re.search(r"```python\n(.*?)```", section("Use it in an engine"), re.DOTALL).group(1)
    exec(compile(code, "README.md (Use it in an engine)", "exec"), {})


@pytest.mark.parametrize("command", sorted(set(re.findall(r"(?:`|bin/)kvcore ([a-z][\w-]*)",
                                                           README))))
def test_every_kvcore_command_in_the_readme_exists(command, capsys):
    with pytest.raises(SystemExit) as exited:
        kvcore_cli([command, "--help"])
    assert exited.value.code == 0, capsys.readouterr().err
