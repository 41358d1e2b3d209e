"""`servprof ...` entry points. Each sub-command lives in the module of its stage;
this file only dispatches, importing a module when its command runs."""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

# command -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("servprof.demo.run_demo", "run the demo server under load, sample it, and report findings"),
    "demo-server": ("servprof.demo.server", "serve the demo LLM (OpenAI-compatible) with servprof on"),
    "analyze": ("servprof.report.analyze_cli", "analyse a torch.profiler / Kineto trace and report findings"),
    "calibrate": ("servprof.detect.calibrate", "measure this device's memory bandwidth and FLOP/s"),
}
# Commands that only read files and write a report: no thread, exporter or server of theirs has
# anything left to do at exit, so they skip the interpreter's teardown (console_main).
ONE_SHOT_COMMANDS = frozenset({"analyze"})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, for the top-level help and errors; only ``command``'s module
    is imported for its arguments (`servprof analyze` must not pay for torch, which the demo's
    modules import)."""
    parser = argparse.ArgumentParser(prog="servprof", description="A profiler that lives inside LLM inference servers.")
    from servprof import __version__

    parser.add_argument("--version", action="version", version=f"servprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module_name)
        if name == command:
            _add_arguments(command_parser, module_name)
    return parser


def command_parser(command: str) -> argparse.ArgumentParser:
    """``servprof COMMAND``'s own parser, the same as its sub-parser in build_parser() (usage,
    help, errors), without the others' set-up (~0.15 ms each, a few percent of a small trace's
    whole analysis)."""
    return _command_parser(command, *COMMANDS[command])


@functools.cache
def _command_parser(command: str, module_name: str, help_text: str) -> argparse.ArgumentParser:
    # Made once per process: main() called again (a test, a benchmark, a script analysing many
    # traces) reuses it; argparse's gettext look-ups stat locale files at every parser made.
    parser = argparse.ArgumentParser(prog=f"servprof {command}", description=help_text)
    parser.set_defaults(command=command, _module=module_name)
    _add_arguments(parser, module_name)
    return parser


def _add_arguments(parser: argparse.ArgumentParser, module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        parser.set_defaults(_import_error=exc)
        return
    module.add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `servprof COMMAND ...`: the other commands' parsers could only show in the top-level help and
    # errors, which need an option or an unknown word before COMMAND.
    if argv and argv[0] in COMMANDS:
        parser = command_parser(argv[0])
        # (A command whose module cannot be imported has no arguments to check: say why below.)
        args = parser.parse_known_args(argv[1:])[0] if parser.get_default("_import_error") else parser.parse_args(argv[1:])
    else:
        parser = build_parser(next((a for a in argv if a in COMMANDS), None))
        args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    error = getattr(args, "_import_error", None)
    if error is not None:
        print(f"servprof {args.command}: unavailable ({error}); try: pip install 'servprof[demo]'", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


def console_main() -> None:
    """The `servprof` command (and `python -m servprof`). A one-shot command exits without the
    interpreter's teardown once its output is flushed, as mypy's command does: freeing numpy's,
    rich's and the trace's objects one by one, and a last collection over them, took 19 of the
    157 ms `servprof analyze` spends on a small trace. Others exit normally: `servprof demo`'s
    exit handlers still flush spans and stop servers."""
    argv = sys.argv[1:]
    code = main(argv)
    if not (argv and argv[0] in ONE_SHOT_COMMANDS):
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a reader that hung up, or a stream closed: nothing left to tell it
        code = code or 1
    os._exit(code)


if __name__ == "__main__":
    console_main()
