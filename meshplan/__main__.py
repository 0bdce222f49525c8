"""`python -m meshplan` runs the `meshplan` command."""

import sys

from meshplan.cli.main import main

if __name__ == "__main__":  # rank processes re-import this module: no re-run there
    sys.exit(main())
