"""`python -m servprof ...`: the `servprof` command."""

import sys

from servprof.cli import main

sys.exit(main())
