"""`python -m jaxshard verify ...`: see `jaxshard/_cli.py`."""

import sys

from ._verify.cli import main


if __name__ == "__main__":
    sys.exit(main())
