"""What the commands print besides their own lines: one clean line per warning, no library chatter.

- Python warnings raised by jaxdist print as `warning: <message>` (the default format adds the file,
  the line number and the source line that raised it).
- absl (orbax, grain) logs at WARNING and below are dropped: they repeat what jaxdist reports in its
  own words (a fallback restore, a read-only manager) and come in pairs with every resume error.
"""

from __future__ import annotations

import logging
import warnings

_default_format = warnings.formatwarning


def _format(message, category, filename, lineno, line=None) -> str:
    if "jaxdist" in str(filename):
        return f"warning: {message}\n"
    return _default_format(message, category, filename, lineno, line)


def libraries() -> None:
    warnings.formatwarning = _format
    logging.getLogger("absl").setLevel(logging.ERROR)
