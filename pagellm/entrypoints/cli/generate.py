"""`pagellm generate PROMPT` (one-shot completion) and `pagellm chat` (REPL or --message)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.chat_utils import load_chat_template


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling: keep the most likely tokens up to this probability mass.")
    g.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens (0 = all).")
    g.add_argument("--min-p", type=float, default=0.0, help="Drop tokens below this fraction of the top token's probability.")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens already in the prompt or output.")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="Penalty for tokens already generated (once each).")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="Penalty per earlier occurrence in the output.")
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    g.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past the end-of-sequence token.")


def sampling_params_from_args(args: argparse.Namespace) -> Any:
    from pagellm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="Complete one or more prompts and print the text.")
    gen.add_argument("prompts", nargs="+", help="Prompt text(s).")
    gen.add_argument("--chat-format", action="store_true", help="Wrap each prompt as a user chat message.")
    add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=run_generate, starts_engine=True)

    chat = sub.add_parser("chat", help="Chat with the model (interactive, or one --message).")
    chat.add_argument("--message", "-m", default=None, help="Send one message, print the reply, exit.")
    chat.add_argument("--system-prompt", default=None, help="A system message to start the chat with.")
    chat.add_argument("--chat-template", default=None, help="Jinja chat template (file path or text).")
    add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=run_chat, starts_engine=True)


def _make_llm(args: argparse.Namespace) -> Any:
    from pagellm.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    return LLM(**vars(engine_args))


def run_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = sampling_params_from_args(args)
    if args.chat_format:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            prefix = "" if args.chat_format else prompt
            print(prefix + completion.text)
            if len(out.outputs) > 1 or len(outputs) > 1:
                print("-" * 40)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    template = load_chat_template(args.chat_template)  # a bad path fails before the model loads
    llm = _make_llm(args)
    params = sampling_params_from_args(args)
    history: list[dict[str, str]] = []
    if args.system_prompt:
        history.append({"role": "system", "content": args.system_prompt})

    def reply(message: str) -> str:
        history.append({"role": "user", "content": message})
        out = llm.chat(history, params, use_tqdm=False, chat_template=template)[0].outputs[0].text
        history.append({"role": "assistant", "content": out})
        return out

    if args.message is not None:
        print(reply(args.message))
        return 0
    print("pagellm chat: type a message; Ctrl-D or /exit to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip():
            print(reply(line))
