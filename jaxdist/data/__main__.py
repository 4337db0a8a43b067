"""`python -m jaxdist.data prepare ...`: the data command (its work is jaxdist/data/prepare.py)."""

import sys

from jaxdist.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
