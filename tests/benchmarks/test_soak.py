"""benchmarks/soak.py's bookkeeping (the hour-long run itself is a benchmark, not a test):
what counts as a fault's failure, how answers are checked, and the mix's requests."""

from __future__ import annotations

import json
import random
import signal

from tests.utils import import_benchmark

soak = import_benchmark("soak")


def test_a_failure_counts_as_a_faults_only_inside_its_window() -> None:
    faults = soak.Faults([(60.0, signal.SIGKILL)], windows=[(100.0, 112.0)])
    assert faults.caused(95.0, 101.0)  # in flight at the signal
    assert faults.caused(105.0, 106.0)  # sent while the core restarted
    assert faults.caused(111.0, 130.0)  # sent inside the margin
    assert not faults.caused(80.0, 99.9)  # ended before
    assert not faults.caused(112.5, 113.0)  # sent after the window closed


def _chat(content: str | None = None, calls: list | None = None, finish: str = "stop") -> dict:
    return {"choices": [{"finish_reason": finish, "message": {"content": content, "tool_calls": calls}}]}


def test_answers_are_checked() -> None:
    assert soak._check("structured", _chat(json.dumps({"name": "Ann", "age": 31}))) == "ok"
    assert soak._check("structured", _chat('{"name": "Ann", "age": "old"}')) == "JSON off the schema"
    assert soak._check("structured", _chat('{"name": ')) == "invalid JSON"
    assert soak._check("structured", _chat('{"name": ', finish="length")) == "ok"  # cut by max_tokens
    call = {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert soak._check("tool", _chat(calls=[call])) == "ok"
    assert soak._check("tool", _chat("It is sunny.")) == "no tool call (finish_reason stop)"
    assert soak._check("plain", {"choices": [{"finish_reason": "length", "text": "x"}]}) == "ok"


def test_the_mix_sends_each_kind() -> None:
    rng = random.Random(0)
    assert sum(soak.MIX.values()) == 100
    paths = {kind: soak._request(kind, rng, 64) for kind in soak.MIX}
    assert paths["stream"][1]["stream"] and paths["n2"][1]["n"] == 2
    assert paths["tool"][1]["tool_choice"] == "required" and paths["tool"][1]["parallel_tool_calls"] is False
    assert paths["structured"][1]["response_format"]["json_schema"]["schema"] == soak.PERSON
    assert len(paths["overlong"][1]["prompt"].split()) > 1024  # past local_server's --max-model-len
    assert {p for p, _ in paths.values()} == {"/v1/completions", "/v1/chat/completions"}


def test_metric_sums_every_engines_series() -> None:
    text = ('# HELP pagellm:num_requests_waiting x\npagellm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'pagellm:num_requests_waiting{engine="1",model_name="m"} 3.0\n'
            'pagellm:num_requests_waiting_other{engine="0"} 7.0\nvllm:num_requests_waiting{engine="0"} 2.0\n')
    assert soak.metric_sum(text, "num_requests_waiting") == 5.0
    assert soak.metric_sum(text, "kv_cache_usage_perc") == 0.0
