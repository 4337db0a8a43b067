"""python -m jaxdist.config: the configuration reference, generated from the dataclasses.

    python -m jaxdist.config                                  # print the key table (Markdown)
    python -m jaxdist.config --write docs/configuration.md    # refresh the table between the page's marks

tests/test_docs.py fails when docs/configuration.md's table is not what this prints.
"""

import argparse
import sys
from pathlib import Path

from jaxdist.config.keys import keys_markdown, with_reference
from jaxdist.errors import command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxdist.config", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--write", metavar="PAGE", help="replace the table between PAGE's config-keys marks in place")
    return p.parse_args(argv)


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write is None:
        print(keys_markdown())
        return 0
    page = Path(args.write)
    text = page.read_text() if page.is_file() else None
    new = with_reference(text, str(page))
    if new != text:
        page.write_text(new)
    print(f"{page}: {'updated' if new != text else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
