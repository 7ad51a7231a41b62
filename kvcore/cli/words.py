"""Library messages in the words of the command line: the flags a user typed instead of the
library's argument names (used by the parser and by the commands)."""

from __future__ import annotations

import re

__all__ = ["in_cli_words"]

#: Library phrases naming library arguments -> the flags a user of ``kvcore <command>``
#: typed (commands not listed keep the library's words).
_CLI_WORDS: tuple[tuple[tuple[str, ...], re.Pattern[str], str], ...] = (
    (("select", "demo"), re.compile(r"requested by the backend argument"),
     "requested by --backend"),
    (("select",), re.compile(r"set KVCORE_PLATFORM=(\S+) KVCORE_DEVICE_CAPABILITY=(\S+) to "
                             r"simulate"),
     r"pass --platform \1 --capability \2 to simulate"),
    (("select",), re.compile(r"set KVCORE_DEVICE_CAPABILITY=(\S+) to simulate"),
     r"pass --capability \1 to simulate"),
)


def in_cli_words(text: str, command: str) -> str:
    """``text`` (a library message) with the argument names ``command`` has as flags
    replaced by those flags."""
    for commands, pattern, replacement in _CLI_WORDS:
        if command in commands:
            text = pattern.sub(replacement, text)
    return text
