"""Speculative decoding (n-gram prompt lookup, and a draft model) on one conversation, with
and without it, pagellm and llama-server in turns.

    python benchmarks/spec_decode.py                                  # pagellm alone
    python benchmarks/spec_decode.py --llama-server $B/llama-server   # and llama.cpp beside
    python benchmarks/spec_decode.py --model l1b.gguf --draft-model default --workloads G,S

Workloads (one request at a time, greedy):
- G (input-grounded): the chat template around "Repeat the following text exactly" and a
  passage of real English (tests/data/public_domain_english.txt, cut into --passages
  pieces of ~--passage-chars characters), up to --max-tokens out, stopping where the model
  stops: the output repeats its input, where prompt lookup pays.
- S (nothing to match): compare.py's S shape, 128 deterministic ids in and --max-tokens out
  with EOS ignored; proposals rarely exist there, so this row shows what speculation
  costs when it cannot help.

Systems: `pagellm` (the default LLM(): engine core in its own process) and `pagellm-ngram`
(the same with --spec-config, vLLM's speculative_config), one live engine each, taking
turns; with --draft-model, `pagellm-draft` (speculative_config {"model": the draft,
"num_speculative_tokens": --draft-k}; --no-ngram leaves pagellm-ngram out); with --llama-server, `llamacpp` (`llama-server -t N -tb N -np 1 --jinja`, compare.py's
thread settings, in the user's own environment) and `llamacpp-ngram` (the same with
--llama-spec-args, default `--spec-type ngram-simple` at its documented sizes), each
started once and asked in the same turns through /v1/chat/completions (G) or /completion
(S, token ids). A request's decode rate is (tokens - 1) / (last token - first token):
pagellm's from RequestOutput.metrics, llama-server's from its `timings`
(predicted_per_second, which counts the first token's step too). Rows: the median over
rounds and passages, the acceptance rate where a system reports one, and the ratios of
each speculative row to its own plain row and to llama-server's speculative row.
Results go to benchmarks/results/spec-decode-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import compare

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "public_domain_english.txt"
S_PROMPT = [1 + (i * 7) % 1000 for i in range(128)]


def passages(count: int, chars: int) -> list[str]:
    """`count` pieces of the text, each ~`chars` characters cut at a sentence end."""
    text = " ".join(TEXT.read_text(encoding="utf-8").split())
    out, start = [], 0
    for _ in range(count):
        end = text.find(". ", start + chars)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end + 1
    return out


def grounded_messages(passage: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Repeat the following text exactly, word for word.\n\n{passage}"}]


class Pagellm:
    """A live LLM() (its engine core in its own process), driven step by step: a request's
    decode rate is (tokens - 1) / (the step that gave the last token - the step that gave
    the first)."""

    def __init__(self, model: str, spec: dict | None) -> None:
        from pagellm import LLM

        self.llm = LLM(model, speculative_config=spec)
        self.engine = self.llm.llm_engine
        self.count = 0
        self.speculates = spec is not None
        self.last_spec: dict[str, int] = {}

    def spec_totals(self) -> dict[str, int]:
        """Verify runs, proposed and accepted tokens, draft forwards since start."""
        return self.engine.engine_core.call_utility("get_spec_decode_totals") if self.speculates else {}

    def _run(self, prompt: Any, params: Any) -> tuple[float, int]:
        self.count += 1
        before = self.spec_totals()
        self.engine.add_request(f"r{self.count}", prompt, params)
        first = last = None
        n = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                now = time.perf_counter()
                got = len(out.outputs[0].token_ids)
                if got > n:
                    first = first if first is not None else now
                    last, n = now, got
        after = self.spec_totals()
        self.last_spec = {k: after[k] - before[k] for k in after}  # this request's verify runs
        return ((n - 1) / (last - first) if n > 1 and last > first else float("nan")), n

    def grounded(self, passage: str, max_tokens: int) -> tuple[float, int]:
        from pagellm import SamplingParams

        tokenizer = self.engine.get_tokenizer()
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(grounded_messages(passage), add_generation_prompt=True,
                                                 tokenize=False)
        else:  # a file without a chat template (the Gemma 3 270M GGUF): Gemma's documented turns
            content = grounded_messages(passage)[0]["content"]
            if "<start_of_turn>" not in tokenizer.get_vocab():
                raise SystemExit("the model has no chat template and no Gemma turn markers")
            text = f"<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n"
        return self._run(text, SamplingParams(temperature=0, max_tokens=max_tokens))

    def stream(self, max_tokens: int) -> tuple[float, int]:
        from pagellm import SamplingParams

        return self._run({"prompt_token_ids": S_PROMPT},
                         SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    def close(self) -> None:
        self.llm.shutdown()


class LlamaServer:
    def __init__(self, binary: str, model: str, extra: list[str]) -> None:
        self.port = compare.free_port()
        cmd = [binary, "-m", model, "--port", str(self.port), "-np", "1", "-c", "8192", "--jinja",
               *compare.llamacpp_threads(), *extra]
        self.proc = subprocess.Popen(cmd, env=compare.system_env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        compare.wait_for_server(self.url, self.proc, 300)
        self.accepted = [0, 0]  # draft tokens accepted, proposed

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def _rate(self, reply: dict) -> tuple[float, int]:
        t = reply["timings"]
        self.accepted[0] += t.get("draft_n_accepted", 0)
        self.accepted[1] += t.get("draft_n", 0)
        return t["predicted_per_second"], t["predicted_n"]

    def grounded(self, passage: str, max_tokens: int) -> tuple[float, int]:
        return self._rate(self._post("/v1/chat/completions", {
            "messages": grounded_messages(passage), "max_tokens": max_tokens, "temperature": 0}))

    def stream(self, max_tokens: int) -> tuple[float, int]:
        return self._rate(self._post("/completion", {
            "prompt": S_PROMPT, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False}))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def projected_speedup(tokens: int, spec: dict[str, int], step_ms: float, row_ms: float) -> float:
    """One request's decode speedup over plain decoding on a model whose one-row step takes
    step_ms and each extra row of a step row_ms, had it made this request's verify runs: its
    tokens - 1 decoded tokens took tokens - 1 - accepted steps, which carried every proposal
    as an extra row."""
    decoded = tokens - 1
    steps = decoded - spec["num_accepted_tokens"]
    return decoded * step_ms / (steps * step_ms + spec["num_draft_tokens"] * row_ms)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or compare.py's names (default: the default model)")
    p.add_argument("--spec-config", default='{"method": "ngram", "num_speculative_tokens": 8, '
                   '"prompt_lookup_max": 5, "prompt_lookup_min": 3}', help="pagellm-ngram's speculative_config")
    p.add_argument("--draft-model", default=None,
                   help="a draft model (a GGUF file or compare.py's names, e.g. 'default'): adds pagellm-draft")
    p.add_argument("--draft-k", type=int, default=4, help="pagellm-draft's num_speculative_tokens")
    p.add_argument("--no-ngram", action="store_true", help="leave the pagellm-ngram row out")
    p.add_argument("--llama-server", default=None, help="llama-server binary: adds the llamacpp rows")
    p.add_argument("--llama-spec-args", default="--spec-type ngram-simple",
                   help="llamacpp-ngram's extra flags")
    p.add_argument("--workloads", default="G,S")
    p.add_argument("--passages", type=int, default=4)
    p.add_argument("--passage-chars", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--project-steps", default=None, metavar="T1,DELTA",
                   help="also print the speedup each speculating request's verify runs would give on a "
                        "model whose one-row step takes T1 ms and each extra row DELTA ms (e.g. a larger "
                        "file whose own acceptance means nothing, measured apart)")
    args = p.parse_args()
    project = tuple(float(v) for v in args.project_steps.split(",")) if args.project_steps else None
    model = compare.resolve_model(args.model)
    spec = json.loads(args.spec_config)
    texts = passages(args.passages, args.passage_chars)
    systems: dict[str, Any] = {"pagellm": Pagellm(model, None)}
    if not args.no_ngram:
        systems["pagellm-ngram"] = Pagellm(model, spec)
    if args.draft_model:
        draft = {"model": compare.resolve_model(args.draft_model), "num_speculative_tokens": args.draft_k}
        systems["pagellm-draft"] = Pagellm(model, draft)
    if args.llama_server:
        systems["llamacpp"] = LlamaServer(args.llama_server, model, [])
        systems["llamacpp-ngram"] = LlamaServer(args.llama_server, model, args.llama_spec_args.split())
    rates: dict[tuple[str, str], list[float]] = {}
    lengths: dict[tuple[str, str], list[int]] = {}
    projected: dict[tuple[str, str], list[float]] = {}
    try:
        for system in systems.values():  # warm-up: kernels, caches, first allocations
            system.stream(8)
        for r in range(args.rounds):
            for workload in args.workloads.split(","):
                jobs = [(i, t) for i, t in enumerate(texts)] if workload == "G" else [(0, None)]
                for i, passage in jobs:
                    order = list(systems) if r % 2 == 0 else list(reversed(systems))
                    for name in order:
                        s = systems[name]
                        rate, n = s.grounded(passage, args.max_tokens) if workload == "G" else s.stream(args.max_tokens)
                        rates.setdefault((name, workload), []).append(rate)
                        lengths.setdefault((name, workload), []).append(n)
                        print(f"round {r} {workload}{i} {name:15s} {rate:7.1f} tok/s ({n} tokens)", flush=True)
                        if project and isinstance(s, Pagellm) and s.speculates and n > 1:
                            projected.setdefault((name, workload), []).append(
                                projected_speedup(n, s.last_spec, *project))
        totals = {name: {"draft_n_accepted": s.accepted[0], "draft_n": s.accepted[1]}
                  for name, s in systems.items() if isinstance(s, LlamaServer) and s.accepted[1]}
        pagellm_totals = {name: s.spec_totals() for name, s in systems.items()
                          if isinstance(s, Pagellm) and s.speculates}
    finally:
        for s in systems.values():
            s.close()
    rows = {}
    print(f"\n{'system':16s} {'workload':8s} {'decode tok/s':>12s} {'tokens':>7s}  ratio")
    for (name, workload), values in rates.items():
        med = statistics.median(values)
        plain = name.removesuffix("-ngram").removesuffix("-draft")
        base = rates.get((plain, workload))
        ratio = med / statistics.median(base) if base and plain != name else None
        rows[f"{name}/{workload}"] = {"median_tok_s": med, "rounds": values, "tokens": lengths[(name, workload)],
                                      "over_plain": ratio}
        peer = rates.get(("llamacpp-ngram", workload))
        vs = f", x{med / statistics.median(peer):.2f} llamacpp-ngram" if peer and name == "pagellm-ngram" else ""
        print(f"{name:16s} {workload:8s} {med:12.1f} {statistics.median(lengths[(name, workload)]):7.0f}  "
              + (f"x{ratio:.2f} over plain" if ratio else "") + vs)
    for name, t in pagellm_totals.items():  # warm-up included
        print(f"{name}: {t['num_accepted_tokens']} of {t['num_draft_tokens']} proposals accepted in "
              f"{t['num_drafts']} verify runs; {t['draft_forwards']} draft forwards")
    for (name, workload), values in projected.items():
        print(f"{name} {workload}: x{statistics.median(values):.2f} over plain projected on a "
              f"{project[0]:g} ms step + {project[1]:g} ms per extra row (median of {len(values)} requests)")
    result = {"machine": compare.describe_machine(quick=True), "model": model, "args": vars(args),
              "rows": rows, "llamacpp_drafts": totals, "pagellm_spec_totals": pagellm_totals,
              "projected_over_plain": {f"{n}/{w}": v for (n, w), v in projected.items()}}
    out = Path(__file__).resolve().parent / "results" / f"spec-decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
