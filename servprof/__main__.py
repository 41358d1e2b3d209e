"""`python -m servprof ...`: the `servprof` command."""

from servprof.cli import console_main

console_main()
