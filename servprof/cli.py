"""`servprof ...` entry points. Each sub-command lives in the module of its stage;
this file only dispatches, importing a module when its command runs."""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("servprof.demo.run_demo", "run the demo server under load, sample it, and report findings"),
    "demo-server": ("servprof.demo.server", "serve the demo LLM (OpenAI-compatible) with servprof on"),
    "analyze": ("servprof.report.analyze_cli", "analyse a torch.profiler / Kineto trace and report findings"),
    "calibrate": ("servprof.detect.calibrate", "measure this device's memory bandwidth and FLOP/s"),
}


def build_parser(command: str | None = None, only: bool = False) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported for its arguments (`servprof analyze`
    must not pay for torch, which the demo's modules import). ``only``: no sub-parser for the
    other commands (each costs ~0.15 ms of argparse set-up, a fifth of a small trace's analysis)."""
    parser = argparse.ArgumentParser(prog="servprof", description="A profiler that lives inside LLM inference servers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only and name != command:
            continue
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module_name)
        if name != command:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            command_parser.set_defaults(_import_error=exc)
            continue
        module.add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `servprof COMMAND ...`: the other commands' parsers could only show in the top-level help and
    # errors, which need an option or an unknown word before COMMAND.
    only = bool(argv) and argv[0] in COMMANDS
    parser = build_parser(argv[0] if only else next((a for a in argv if a in COMMANDS), None), only)
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


if __name__ == "__main__":
    sys.exit(main())
