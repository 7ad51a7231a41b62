"""A peer connector in a subprocess, for the two-process connector tests (nixl, mooncake)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path


class Peer:
    """``python SCRIPT ARGS`` (a producer); its stdout lines arrive on a queue, readable with
    a timeout. ``env`` adds to this process's environment (e.g. a library's log level)."""

    def __init__(self, script: Path, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, str(script), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float | None = None) -> str:
        timeout = self.timeout if timeout is None else timeout
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"the producer said nothing within {timeout} s; stderr: "
                                 f"{self.proc.stderr.read()[-2000:]}") from None

    def port(self) -> int:
        line = self.line()
        assert line.startswith("port "), line
        return int(line.split()[1])
