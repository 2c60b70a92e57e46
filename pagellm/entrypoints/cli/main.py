"""The `pagellm` command (also `python -m pagellm`): generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_parser(subparsers) and run(args)
_SUBCOMMANDS = {
    "generate": "pagellm.entrypoints.cli.generate",
    "chat": "pagellm.entrypoints.cli.generate",
    "serve": "pagellm.entrypoints.cli.serve",
    "bench": "pagellm.entrypoints.cli.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: LLM inference and serving.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="{generate,chat,serve,bench}")
    seen = set()
    for module_name in _SUBCOMMANDS.values():
        if module_name in seen:
            continue
        seen.add(module_name)
        importlib.import_module(module_name).add_parsers(sub)
    return parser


def _version() -> str:
    from pagellm import __version__

    return f"pagellm {__version__}"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    from pagellm.engine.exceptions import EngineStartupError

    try:
        code = args.func(args) or 0
    except (ValueError, FileNotFoundError, TypeError, EngineStartupError) as e:
        # Bad options or inputs: one clear line, not a traceback.
        print(f"pagellm {args.command}: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
