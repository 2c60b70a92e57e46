"""The `pagellm` command (also `python -m pagellm`): generate, chat, serve, bench, tokenizer."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from typing import Any

# subcommand -> module with add_parser(subparsers) and run(args)
_SUBCOMMANDS = {
    "generate": "pagellm.entrypoints.cli.generate",
    "chat": "pagellm.entrypoints.cli.generate",
    "serve": "pagellm.entrypoints.cli.serve",
    "bench": "pagellm.entrypoints.cli.bench",
    "tokenizer": "pagellm.entrypoints.cli.tokenizer",
}


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" where a default says something: not for None (the help says
    what happens then) nor for on/off switches that are off."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)


class CLIParser(argparse.ArgumentParser):
    """Every parser of the CLI, subcommands included (argparse makes subparsers of the
    parent's class): no prefix matching (`--max-token` is not `--max-tokens`), and each
    flag's default in --help."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(**kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or with `command` only that subcommand's module (the others import
    what they need: the server starlette, the benchmarks aiohttp and numpy)."""
    parser = CLIParser(prog="pagellm", description="pagellm: LLM inference and serving.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="{generate,chat,serve,bench,tokenizer}")
    modules = [_SUBCOMMANDS[command]] if command in _SUBCOMMANDS else _SUBCOMMANDS.values()
    for module_name in dict.fromkeys(modules):
        importlib.import_module(module_name).add_parsers(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand argv names, when its first argument is one (`pagellm serve ...`);
    None otherwise (`pagellm --help`, a typo), which builds the whole parser."""
    return argv[0] if argv and argv[0] in _SUBCOMMANDS else None


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser (`pagellm bench throughput` -> its own), so an
    error shows the usage of the command the user typed."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen_parser(action.choices[name], args)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """The checks SamplingParams and EngineArgs make anyway, made on the parsed flags
    before any model loads (ValueError/TypeError with the same messages)."""
    if hasattr(args, "max_tokens") and hasattr(args, "sampling_seed"):
        from pagellm.entrypoints.cli.generate import sampling_params_from_args

        sampling_params_from_args(args)
    from pagellm.engine.arg_utils import EngineArgs

    if all(hasattr(args, f.name) for f in dataclasses.fields(EngineArgs)):
        EngineArgs.from_cli_args(args).verify_args()


def _runs_one_engine_process(args: argparse.Namespace) -> bool:
    """Whether the command will start one engine-core process, rank 0, on IPC sockets
    (generate, chat and serve without data parallelism, multiprocessing on)."""
    from pagellm import envs

    return (getattr(args, "starts_engine", False) and envs.PAGELLM_ENABLE_MULTIPROCESSING
            and getattr(args, "data_parallel_size", 1) == 1 and not getattr(args, "headless", False)
            and getattr(args, "data_parallel_address", None) is None
            and getattr(args, "data_parallel_backend", "mp") == "mp")


def _version() -> str:
    from pagellm import __version__

    return f"pagellm {__version__}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_of(argv))
    args, unknown = parser.parse_known_args(argv)
    chosen = _chosen_parser(parser, args)
    if unknown:
        chosen.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    try:
        check_args(args)
    except (ValueError, TypeError) as e:
        chosen.error(str(e))
    if _runs_one_engine_process(args):
        from pagellm.engine.prestart import prestart_engine_core

        prestart_engine_core()  # it imports torch while the frontend reads the config
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
