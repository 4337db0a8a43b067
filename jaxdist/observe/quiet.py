"""What the commands print besides their own lines: one clean line per warning, no library chatter.

- Python warnings raised by jaxdist print as `warning: <message>` (the default format adds the file,
  the line number and the source line that raised it).
- absl (orbax, grain) and asyncio logs are dropped below CRITICAL, and orbax's background threads
  print no tracebacks: they repeat what jaxdist reports in its own words (a fallback restore, a save
  that failed on a full disk: one line, where orbax's threads printed hundreds).
- "Event loop is closed" at exit: after a failed save or restore, tensorstore completes a future whose
  orbax event loop is already closed; Python reports it as an unraisable exception with a traceback.
  Nothing is lost at that point, so it is not printed.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings

_default_format = warnings.formatwarning


def _format(message, category, filename, lineno, line=None) -> str:
    if "jaxdist" in str(filename):
        return f"warning: {message}\n"
    return _default_format(message, category, filename, lineno, line)


def _from_orbax(tb) -> bool:
    while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


_default_hook = threading.excepthook


def _thread_hook(args) -> None:
    if not _from_orbax(args.exc_traceback):  # orbax's own failures reach jaxdist through the manager
        _default_hook(args)


_default_unraisable = sys.unraisablehook


def _unraisable(args) -> None:
    if not (isinstance(args.exc_value, RuntimeError) and str(args.exc_value) == "Event loop is closed"):
        _default_unraisable(args)


def libraries() -> None:
    warnings.formatwarning = _format
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    threading.excepthook = _thread_hook
    sys.unraisablehook = _unraisable
