"""Running the ``kvcore`` command in the test's own process."""

from __future__ import annotations


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``kvcore ARGS`` in this process: (exit status, stdout, stderr)."""
    from kvcore.cli import main

    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's errors
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err
