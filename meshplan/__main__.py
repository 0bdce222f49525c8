"""`python -m meshplan` runs the `meshplan` command."""

import sys

from meshplan.cli.main import main

sys.exit(main())
