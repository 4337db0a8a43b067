"""The one exception type users see: a one-line message naming the cause and the fix."""

from __future__ import annotations

import argparse
import errno
import functools
import sys
from collections.abc import Callable
from typing import Protocol


class JaxdistError(Exception):
    """A problem with the user's input or environment. The CLI prints it without a traceback, exit 2."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(e: BaseException) -> bool:
    """A failed write that only more room fixes: ENOSPC / EDQUOT / EFBIG, as an OSError or in the text of a
    library's own error (safetensors' `SafetensorError: ... IoError(Os { code: 28, kind: StorageFull ...`)."""
    if isinstance(e, OSError):
        return e.errno in DISK_FULL
    text = str(e)
    return "StorageFull" in text or "No space left on device" in text or "Disk quota exceeded" in text


class Command(Protocol):
    """A command's entry point: `main(argv=None) -> exit code` (argv None: the process's arguments)."""

    def __call__(self, argv: list[str] | None = None) -> int: ...


def command(main: Callable[[list[str] | None], int]) -> Command:
    """Decorate a command's `main(argv) -> exit code`: a JaxdistError ends it with one `error: ...` line
    on stderr and exit status 2 (no traceback), as every jaxdist command does."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except JaxdistError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a bad flag value as one `error:` line (a JaxdistError), not the usage block."""

    def error(self, message: str):
        raise JaxdistError(f"{self.prog}: {message}; see {self.prog} --help")
