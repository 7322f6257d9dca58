"""`python -m jaxshard verify ...`, `show ...` and `annotate ...`: see
`jaxshard/_verify/cli.py` and `jaxshard/_annotate/cli.py`."""

import sys

from ._annotate.cli import add_command
from ._verify.cli import main


if __name__ == "__main__":
    sys.exit(main(more=(add_command,)))
