"""The suite's cost per test file, for the order in which `-n 3 --dist loadfile` hands files out.

    python -m pytest -n 3 --dist loadfile --durations=0 > run.log
    python scripts/checks/test_durations.py run.log          # writes tests/durations.json

Sums each file's setup, call and teardown seconds from a `--durations=0` log and writes them, heaviest
first, to `tests/durations.json`; tests/conftest.py queues the files in that order (a file the table
lacks first of all), so that no heavy file starts last while the other workers have nothing left to do.
Rerun it after a change moves a file's cost by much; the order is all it is used for.
"""

import argparse
import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"([\d.]+)s (?:call|setup|teardown)\s+tests/(test_\w+\.py)::")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("log", help="the output of a pytest run with --durations=0")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "tests" / "durations.json"))
    args = p.parse_args()
    if not Path(args.log).is_file():
        print(f"error: no file {args.log}; give the log of a pytest run with --durations=0", file=sys.stderr)
        return 2
    seconds: collections.Counter[str] = collections.Counter()
    for line in Path(args.log).read_text().splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        print(f"error: no --durations=0 lines in {args.log}; run pytest with --durations=0", file=sys.stderr)
        return 2
    table = {name: round(s, 1) for name, s in seconds.most_common()}
    Path(args.out).write_text(json.dumps(table, indent=0) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s summed -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
