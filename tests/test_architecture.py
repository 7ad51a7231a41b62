"""The dependency rule, checked on the source: kvcore imports no plugin, and plugins (the
in-repo ones under ``plugins/`` and the example under ``examples/``) use only kvcore's public
API: the names ``kvcore``, ``kvcore.ops``, ``kvcore.ops.triton_utils`` (helpers for plugin Triton
kernels), ``kvcore.connectors`` and ``kvcore.testing`` export.

The plugin packages are found by scanning those directories and the installed ``kvcore.plugins``
entry points, so a new plugin is covered without editing this file. ``.importlinter`` states
the same rules for import-linter, which also follows indirect imports.
"""

from __future__ import annotations

import ast
import configparser
import importlib
import importlib.util
import itertools
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PUBLIC_MODULES = ("kvcore", "kvcore.ops", "kvcore.ops.triton_utils", "kvcore.ops.triton_launch",
                  "kvcore.connectors", "kvcore.testing")
PLUGIN_DIRS = ("plugins", "examples")
_SKIP_PARTS = {"build", "dist", "__pycache__"}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not _SKIP_PARTS & set(p.relative_to(root).parts)
                  and not any(part.endswith(".egg-info") for part in p.parts))


def plugin_distributions() -> list[Path]:
    return sorted(d for top in PLUGIN_DIRS for d in (REPO / top).glob("*")
                  if (d / "pyproject.toml").is_file())


def plugin_packages() -> set[str]:
    """Top-level packages of the in-repo plugins and of every installed third-party plugin."""
    names = {p.name for d in plugin_distributions() for p in d.iterdir()
             if (p / "__init__.py").is_file() and p.name != "tests"}
    for ep in metadata.entry_points(group="kvcore.plugins"):
        if ep.dist is not None and ep.dist.metadata["Name"].lower() != "kvcore":
            names.add(ep.value.split(".")[0].split(":")[0])
    return names


def imports(path: Path) -> list[tuple[int, str, list[str], str | None]]:
    """``(line, module, imported names, bound name)``.

    ``import a.b`` has no names and binds ``a``; ``import a.b as c`` binds ``c`` to ``a.b``;
    ``from a import x`` binds nothing of interest here.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, [], alias.asname or alias.name.split(".")[0])
                         for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names], None))
    return found


def public_names(module: str) -> set[str]:
    names = set(importlib.import_module(module).__all__)
    # Public subpackages are reachable as attributes too (``kvcore.ops.paged_attention``).
    return names | {m.rsplit(".", 1)[1] for m in PUBLIC_MODULES if m.startswith(f"{module}.")}


def attribute_chains(path: Path, aliases: dict[str, str]) -> list[tuple[int, str, str]]:
    """``(line, module, attribute)`` for ``alias.attribute`` where alias names a kvcore module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases:
            found.append((node.lineno, aliases[node.value.id], node.attr))
    return found


def private_uses(path: Path, root: Path = REPO) -> list[str]:
    """Every use in ``path`` of a kvcore name outside the public API, one line each."""
    problems = []
    aliases: dict[str, str] = {}
    for line, module, names, bound in imports(path):
        if module.split(".")[0] != "kvcore":
            continue
        where = f"{path.relative_to(root)}:{line}"
        if module not in PUBLIC_MODULES:
            problems.append(f"{where}: imports {module}, which is not public API "
                            f"(public: {', '.join(PUBLIC_MODULES)})")
            continue
        if bound is not None:
            aliases[bound] = module if bound != "kvcore" else "kvcore"
        for name in sorted(set(names) - public_names(module)):
            problems.append(f"{where}: imports {name} from {module}, which does not export it "
                            f"(not in {module}.__all__)")
    for line, module, attr in attribute_chains(path, aliases):
        if attr not in public_names(module):
            problems.append(f"{path.relative_to(root)}:{line}: uses {module}.{attr}, which is "
                            f"not in {module}.__all__")
    return problems


def test_kvcore_imports_no_plugin():
    forbidden = plugin_packages()
    assert {"kvcore_example_plugin"} <= forbidden
    problems = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in python_files(REPO / "kvcore")
        for line, module, _, _ in imports(path) if module.split(".")[0] in forbidden
    ]
    assert not problems, "kvcore must not import plugins:\n" + "\n".join(problems)


@pytest.mark.parametrize("distribution", plugin_distributions(),
                         ids=lambda d: str(d.relative_to(REPO)))
def test_plugin_uses_only_public_kvcore_api(distribution):
    problems = [p for path in python_files(distribution) for p in private_uses(path)]
    assert not problems, "\n".join(problems)


def test_tools_use_only_public_kvcore_api():
    """The command line and the demo (kvcore.cli, kvcore.demo) sit outside the contract: they
    use kvcore's public API and each other, as a third party would."""
    # ... and kvcore.testing.compile_check, which owns the `kvcore kernels` command.
    own = r"imports kvcore\.(cli|demo|testing\.compile_check)\b|compile_check from kvcore\.testing"
    problems = [p for top in ("cli", "demo") for path in python_files(REPO / "kvcore" / top)
                for p in private_uses(path) if not re.search(own, p)]
    assert not problems, "\n".join(problems)


def test_the_guard_catches_private_imports(tmp_path):
    source = tmp_path / "plugin.py"
    source.write_text(
        "import kvcore\n"
        "from kvcore.backend import AttentionBackend\n"
        "from kvcore.ops import _on_gpu, paged_attention\n"
        "x = kvcore.registry\n"
        "y = kvcore.AttentionBackend\n"
        "import kvcore.connectors as kc\n"
        "z = kc.base\n")
    assert private_uses(source, root=tmp_path) == [
        "plugin.py:2: imports kvcore.backend, which is not public API (public: kvcore, "
        "kvcore.ops, kvcore.ops.triton_utils, kvcore.ops.triton_launch, kvcore.connectors, "
        "kvcore.testing)",
        "plugin.py:3: imports _on_gpu from kvcore.ops, which does not export it "
        "(not in kvcore.ops.__all__)",
        "plugin.py:4: uses kvcore.registry, which is not in kvcore.__all__",
        "plugin.py:7: uses kvcore.connectors.base, which is not in kvcore.connectors.__all__",
    ]


@pytest.mark.skipif(importlib.util.find_spec("importlinter") is None,
                    reason="import-linter is not installed (pip install import-linter)")
def test_import_linter_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), str(REPO / ".importlinter")], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_importlinter_covers_every_plugin_the_dev_setup_installs():
    """Plugins installed by requirements-dev.txt are importable in CI, so lint-imports checks
    them; ``.importlinter`` must name each in root_packages and in both contracts."""
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    installed = re.findall(r"^-e ((?:plugins|examples)/\S+)$",
                           (REPO / "requirements-dev.txt").read_text(), re.MULTILINE)
    packages = {p.name for d in installed for p in (REPO / d).iterdir()
                if (p / "__init__.py").is_file() and p.name != "tests"}
    assert packages

    def listed(section: str, key: str) -> set[str]:
        return set(config[section][key].split())

    assert packages <= listed("importlinter", "root_packages")
    assert packages <= listed("importlinter:contract:core-imports-no-plugin",
                              "forbidden_modules")
    assert packages <= listed("importlinter:contract:plugins-use-public-api", "source_modules")


def test_every_kvcore_module_is_on_a_floor_of_the_layers_contract():
    """A new module or subpackage of kvcore gets a floor in ``.importlinter``'s layers contract,
    which decides what it may import (lint-imports checks the floors themselves)."""
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    floors = config["importlinter:contract:kvcore-layers"]["layers"]
    named = set(re.findall(r"kvcore\.\w+", floors))
    modules = {f"kvcore.{p.stem}" for p in (REPO / "kvcore").iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert "kvcore.dtypes" in modules
    missing = sorted(modules - named)
    assert not missing, f"not on any floor of the kvcore-layers contract: {', '.join(missing)}"


def layer_floors() -> list[set[str]]:
    """``.importlinter``'s kvcore-layers contract, top floor first: each floor's modules."""
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    lines = config["importlinter:contract:kvcore-layers"]["layers"].strip().splitlines()
    return [set(re.findall(r"kvcore\.\w+", line)) for line in lines]


def test_the_architecture_page_shows_the_floors_of_the_layers_contract():
    """docs/architecture.md's floor table names the contract's modules, top to bottom in the
    contract's order (modules of one floor in any order among themselves)."""
    page = (REPO / "docs" / "architecture.md").read_text()
    table = re.search(r"## The floors\n\n```text\n(.*?)```", page, re.S)
    assert table, "docs/architecture.md has no ```text floor table under '## The floors'"
    shown = list(dict.fromkeys(re.findall(r"kvcore\.\w+", table.group(1))))
    floors = layer_floors()
    floor_of = {module: i for i, floor in enumerate(floors) for module in floor}
    assert set(shown) == set(floor_of), (
        f"the table lacks {sorted(set(floor_of) - set(shown))} and shows "
        f"{sorted(set(shown) - set(floor_of))}, which are not floors of .importlinter")
    order = [floor_of[m] for m in shown]
    wrong = [(a, b) for a, b in itertools.pairwise(shown) if floor_of[b] < floor_of[a]]
    assert order == sorted(order), f"the table shows these above the floor they sit on: {wrong}"


#: Packages whose modules must not import each other in a loop (kvcore and the in-repo plugins
#: requirements-dev.txt installs).
ACYCLIC_PACKAGES = ("kvcore", "kvcore_nvidia", "kvcore_rocm", "kvcore_mla")


def import_cycles(package: str) -> list[list[str]]:
    """The import cycles among ``package``'s modules, each as the sorted modules of one
    strongly connected component of grimp's import graph. grimp reads every import statement,
    those inside functions included, so a loop closed by a lazy import counts too."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    inside = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & inside) for m in inside}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    # Tarjan's strongly connected components, iteratively (no recursion limit on deep chains).
    for root in sorted(inside):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(cycles)


@pytest.mark.skipif(importlib.util.find_spec("grimp") is None,
                    reason="grimp is not installed (it comes with import-linter)")
@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    """No module of ``package`` imports, directly or through others, a module that imports it
    back, not even from inside a function: each concern sits above what it uses."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    cycles = import_cycles(package)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.skipif(importlib.util.find_spec("grimp") is None,
                    reason="grimp is not installed (it comes with import-linter)")
def test_the_cycle_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    package = tmp_path / "loopy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loopy import b\n")
    (package / "b.py").write_text("def f():\n    from loopy import a\n")
    (package / "c.py").write_text("from loopy import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("loopy") == [["loopy.a", "loopy.b"]]
