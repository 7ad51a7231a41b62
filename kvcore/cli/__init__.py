"""The ``kvcore`` command and the tools behind it, apart from the contract: argument parsing
(:mod:`kvcore.cli.main`), the subcommands (:mod:`kvcore.cli.commands`), ``kvcore bench`` and
the benchmark harness that ``benchmarks/*.py`` share (:mod:`kvcore.cli.bench`,
:mod:`kvcore.cli.harness`), the layout view and plots. Everything here uses kvcore's public API
only; its third-party dependencies are the ``kvcore[cli]`` extra.
"""

from kvcore.cli.main import main

__all__ = ["main"]
