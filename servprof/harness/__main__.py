"""`python -m servprof.harness --help`: the harness's locust options. (locust prints its own
`--help` before it imports a locustfile, so the options a locustfile adds are not in it.)"""

from __future__ import annotations

import argparse
import sys

from servprof.harness.plugin import add_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="locust -f servprof/harness/locustfile.py -H URL",
        description="servprof's locust harness: these options go on locust's command line (or its web UI); "
                    "the rest are locust's own (locust --help). See docs/harness.md.")
    add_arguments(parser)
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
