"""Run every ``kvcore`` command that the README and ``docs/`` show, as written, and time it.

A command is a line of a fenced ``bash``/``sh``/``console`` block that starts with ``kvcore``
(a ``# comment`` after it is dropped). The commands of ``docs/backend-plugin.md`` test the
page's own plugin: they run with its minimal backend (the block after
``<!-- ci:minimal-backend -->``) installed as the page says, entry point ``acme =
"acme_kvcore"``, into a temporary folder on ``PYTHONPATH``. Each runs in its own process under
a time limit; the
table printed last gives where it is written, its exit code and its wall time, and a JSON file
keeps the same rows with each command's last output lines. ``--repeat`` runs the list again
(the first pass builds what the second loads from the caches: cold and warm times).

Usage: ``python benchmarks/doc_commands.py [--out DIR] [--skip REGEX] [--limit-s S]
[--repeat] [--list]``; the exit code is 1 when a command that ran failed or timed out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvcore.cli.harness import script_parser

ROOT = Path(__file__).resolve().parent.parent
SHELL_FENCES = ("bash", "sh", "console", "shell")
PLUGIN_PAGE = "docs/backend-plugin.md"
PLUGIN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-kvcore"
version = "0.0.0"

[project.entry-points."kvcore.plugins"]
acme = "acme_kvcore"

[tool.setuptools]
py-modules = ["acme_kvcore"]
"""


@dataclass
class DocCommand:
    """One command as a document writes it, and what running it gave."""

    where: str
    command: str
    runs: list[dict] = field(default_factory=list)


def doc_commands(root: Path = ROOT) -> list[DocCommand]:
    """The ``kvcore`` commands of ``README.md`` and ``docs/*.md``'s shell blocks, in order,
    each once (the first place it is written)."""
    found: dict[str, DocCommand] = {}
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        fence: str | None = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = line.strip()
            if text.startswith("```"):
                fence = None if fence is not None else text[3:].strip()
                continue
            if fence not in SHELL_FENCES:
                continue
            text = text.removeprefix("$ ")
            if not re.match(r"kvcore(\s|$)", text):
                continue
            command = text.split(" #", 1)[0].strip()
            found.setdefault(command, DocCommand(f"{path.relative_to(root)}:{number}", command))
    return list(found.values())


def page_backend(root: Path = ROOT) -> str:
    """The source of :data:`PLUGIN_PAGE`'s minimal backend: the python block after its
    ``<!-- ci:minimal-backend -->`` marker (what an author copies)."""
    page = (root / PLUGIN_PAGE).read_text()
    match = re.search(r"<!-- ci:minimal-backend -->\n```python\n(.*?)```", page, re.DOTALL)
    if match is None:
        raise ValueError(f"{PLUGIN_PAGE} has no python block after <!-- ci:minimal-backend -->")
    return match.group(1)


def install_page_plugin(folder: Path, root: Path = ROOT) -> dict[str, str]:
    """Install :data:`PLUGIN_PAGE`'s minimal backend as a plugin distribution into
    ``folder`` (offline, no dependencies); returns the environment its commands run in."""
    source = folder / "acme-kvcore"
    source.mkdir()
    (source / "acme_kvcore.py").write_text(page_backend(root))
    (source / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    site = folder / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(source)], check=True)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site)}


def run_command(command: str, limit_s: float, env: dict[str, str] | None = None) -> dict:
    """Run ``command`` (split like a shell would, no shell) in the repository root."""
    env = dict(os.environ if env is None else env)
    # `kvcore` is this interpreter's environment's (where a virtualenv is not activated).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    start = time.perf_counter()
    try:
        done = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True,
                              timeout=limit_s, env=env)
        code, output = done.returncode, done.stdout + done.stderr
    except OSError as exc:  # the program is missing
        code, output = "not run", str(exc)
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
    return {"rc": code, "wall_s": round(time.perf_counter() - start, 1),
            "tail": output.strip().splitlines()[-15:]}


def main() -> int:
    parser = script_parser(__doc__, ROOT / "benchmarks" / "results")
    parser.add_argument("--skip", default=None,
                        help="a regular expression: commands it matches are listed, not run")
    parser.add_argument("--limit-s", type=float, default=180.0, help="per command")
    parser.add_argument("--repeat", action="store_true", help="a second (warm) pass")
    parser.add_argument("--list", action="store_true", help="only list the commands")
    args = parser.parse_args()
    commands = doc_commands()
    skip = re.compile(args.skip) if args.skip else None
    console = Console(width=160)
    scratch = tempfile.TemporaryDirectory(prefix="kvcore-doc-plugin-")
    plugin_env = None
    for entry in commands:
        if args.list or (skip and skip.search(entry.command)):
            continue
        env = None
        if entry.where.startswith(PLUGIN_PAGE + ":"):
            plugin_env = plugin_env or install_page_plugin(Path(scratch.name))
            env = plugin_env
        for _ in range(2 if args.repeat else 1):
            entry.runs.append(run_command(entry.command, args.limit_s, env))
            run = entry.runs[-1]
            console.print(f"{entry.where}: {entry.command}: rc={run['rc']} {run['wall_s']} s")
            if run["rc"] != 0:
                console.print("\n".join("    " + line for line in run["tail"]), markup=False,
                              highlight=False)
    if not args.list:  # a listing runs nothing: no results to keep
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "doc_commands.json").write_text(json.dumps([asdict(c) for c in commands],
                                                              indent=1))
    table = Table("where", "command", "result", "first s", "again s")
    failed = False
    for entry in commands:
        if not entry.runs:
            table.add_row(entry.where, entry.command, "listed" if args.list else "skipped", "", "")
            continue
        ok = all(run["rc"] == 0 for run in entry.runs)
        failed |= not ok
        result = "pass" if ok else "FAIL rc=" + ",".join(str(run["rc"]) for run in entry.runs)
        table.add_row(entry.where, entry.command, result, str(entry.runs[0]["wall_s"]),
                      str(entry.runs[1]["wall_s"]) if len(entry.runs) > 1 else "")
    console.print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
