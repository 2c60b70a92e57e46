"""vLLM's `prompt_logprobs` on the server (issue #34): `choices[i].prompt_logprobs` on
/v1/completions, a top-level `prompt_logprobs` on /v1/chat/completions, each a list of
`{token_id: {logprob, rank, decoded_token}}` with `null` first, equal to what
`LLM.generate(..., SamplingParams(prompt_logprobs=k))` returns offline on the same model;
refused with stream and past --max-logprobs."""

from __future__ import annotations

import httpx
import pytest

from pagellm import LLM, SamplingParams
from tests.entrypoints.openai.conftest import ServerProcess

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def offline():
    llm = LLM(max_model_len=1024)
    yield llm
    llm.shutdown()


def _post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {srv.api_key}"})


def _expected(prompt_logprobs: list) -> list:
    """RequestOutput.prompt_logprobs as the server's JSON (token ids become string keys)."""
    return [
        None if entry is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def test_completions_prompt_logprobs_equal_offline(server, offline) -> None:
    want = offline.generate(PROMPT, SamplingParams(prompt_logprobs=3, max_tokens=1, temperature=0),
                            use_tqdm=False)[0]
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 3, "max_tokens": 1,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    got = choice["prompt_logprobs"]
    assert got == _expected(want.prompt_logprobs)
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for token_id, entry in zip(want.prompt_token_ids[1:], got[1:]):
        # the prompt's own token first, with its rank, then the top 3 ranked 1..3
        own = entry[str(token_id)]["rank"]
        assert next(iter(entry)) == str(token_id) and own >= 1
        assert [e["rank"] for e in list(entry.values())[1:]] == [r for r in (1, 2, 3) if r != own]


def test_completions_prompt_logprobs_zero_and_per_prompt(server, offline) -> None:
    prompts = [PROMPT, "One, two, three,"]
    wants = offline.generate(prompts, SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0),
                             use_tqdm=False)
    r = _post(server, "/v1/completions", {"prompt": prompts, "n": 2, "prompt_logprobs": 0,
                                          "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    for choice in choices:  # index = prompt index * n + completion index
        want = wants[choice["index"] // 2]
        assert choice["prompt_logprobs"] == _expected(want.prompt_logprobs)
        assert all(len(e) == 1 for e in choice["prompt_logprobs"][1:])  # only the prompt's token


def test_chat_prompt_logprobs_equal_offline(server, offline) -> None:
    want = offline.chat(MESSAGES, SamplingParams(prompt_logprobs=2, max_tokens=1, temperature=0),
                        use_tqdm=False)[0]
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 2,
                                               "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_logprobs"] == _expected(want.prompt_logprobs)
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert "prompt_logprobs" not in body["choices"][0]
    plain = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert plain["prompt_logprobs"] is None


def test_echo_logprobs_stay_their_width_beside_prompt_logprobs(server) -> None:
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1,
                                          "prompt_logprobs": 4, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    n_prompt = len(choice["prompt_logprobs"])
    echoed = choice["logprobs"]["top_logprobs"][:n_prompt]
    assert echoed[0] is None and all(1 <= len(e) <= 2 for e in echoed[1:])  # token + top 1
    assert all(len(e) >= 4 for e in choice["prompt_logprobs"][1:])  # top 4 (+ the token)
    for entry, top in zip(choice["prompt_logprobs"][1:], echoed[1:]):
        best = min(entry.values(), key=lambda e: e["rank"])
        assert top[best["decoded_token"]] == best["logprob"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "stream"),
        ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True}, "stream"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "max allowed: 20"),
        ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": -1}, "max allowed: 20"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -2}, "greater than or equal to -1"),
    ],
    ids=["completions-stream", "chat-stream", "over-cap", "whole-vocabulary", "below-minus-one"],
)
def test_bad_prompt_logprobs_are_a_400(server, path, body, message) -> None:
    prompt_tokens = server.metric("pagellm:prompt_tokens_total")
    r = _post(server, path, {**body, "max_tokens": 1})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and err["code"] == 400 and message in err["message"]
    assert server.metric("pagellm:prompt_tokens_total") == prompt_tokens  # nothing ran
