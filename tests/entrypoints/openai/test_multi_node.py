"""Multi-node data parallelism on one machine: a head (`pagellm serve -dp 2
--data-parallel-size-local 1 --data-parallel-address 127.0.0.1 ...`) and a `--headless`
node as two process groups over loopback TCP. Requests land on both ranks, greedy text
equals a single engine's, a killed remote core fails its streams with the 503 event and
serves again once its node has started a new one, and a node whose flags differ from the
head's is refused with the field named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from tests.entrypoints.openai.conftest import ServerProcess
from tests.entrypoints.openai.test_engine_restart import (
    _auth,
    _kill_under_load,
    _wait_healthy,
)
from tests.utils import import_benchmark

_free_port_pair = import_benchmark("compare").free_port_pair

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "Once upon a time"]


def _headless(model: str, rpc_port: int, *extra: str, stderr=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagellm", "serve", model, "--headless", "-dp", "2", "--data-parallel-size-local", "1",
           "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
           str(rpc_port), "--max-model-len", "2048", *extra]
    return subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stderr=stderr, text=stderr is not None)


def _head(model: str, rpc_port: int, *extra: str, wait: bool = True) -> ServerProcess:
    return ServerProcess("--model", model, "-dp", "2", "--data-parallel-size-local", "1",
                         "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
                         "--max-model-len", "2048", *extra, wait=wait)


def _core_pids(pid: int) -> dict[int, int]:
    """rank -> pid of each engine-core process under process `pid`."""
    pids = {}
    for p in psutil.Process(pid).children(recursive=True):
        cmd = p.cmdline()
        if "pagellm.core.engine_core_proc" in cmd:
            pids[int(cmd[cmd.index("--rank") + 1])] = p.pid
    return pids


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _single_engine_texts(model: str) -> list[str]:
    """What one engine answers: LLM in this process, same flags, greedy."""
    from pagellm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=2048)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
        return [o.outputs[0].text for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def _success(srv: ServerProcess, rank: int) -> float:
    return srv.metric(f'pagellm:request_success_total{{engine="{rank}",finished_reason="length"')

def _kill_rank_1_under_load(srv: ServerProcess, pid: int, cause: str) -> None:
    """Four 1500-token streams over two ranks, then SIGKILL of `pid` (rank 1's core): rank
    1's two streams end with the 503 event naming `cause` within 2 s of the kill, rank 0's
    two finish."""

    # still running at the kill
    results, killed_at = _kill_under_load(srv, pid, streams=4, max_tokens=1500, timeout=120)
    failed = [r for r in results if r["error"] is not None]
    completed = [r for r in results if r["error"] is None]
    assert len(failed) == 2 and len(completed) == 2  # rank 1's two fail, rank 0's finish
    assert all(r["tokens"] == 1500 and r["done"] for r in completed)
    for r in failed:
        assert r["done"] and r["error"]["code"] == 503
        assert r["error"]["message"] == (f"The engine core serving this request died ({cause}) and is "
                                         "restarting; retry the request.")
        assert r["error_at"] - killed_at < 2



@pytest.fixture(autouse=True)
def one_thread_per_core(monkeypatch) -> None:
    """Both "nodes" share this machine: one thread per engine core, as one server's ranks
    would split it (a node alone on a machine takes all its cores)."""
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "1")


def test_head_and_headless_node_serve_both_ranks_and_a_killed_remote_core_comes_back(tiny_model) -> None:
    model = tiny_model("llama", max_position_embeddings=2048)
    port = _free_port_pair()
    node = _headless(model, port, "--restart-engine-on-failure")
    head = None
    try:
        head = _head(model, port, "--restart-engine-on-failure")  # up once both ranks have handshaken
        assert list(_core_pids(head.proc.pid)) == [0]
        (old_remote,) = _core_pids(node.pid).items()
        assert old_remote[0] == 1

        # one request at a time: the balancer alternates, two on each rank
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(head.url + "/v1/completions", headers=_auth(head), timeout=60,
                           json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            texts.append(r.json()["choices"][0]["text"])
        assert (_success(head, 0), _success(head, 1)) == (2, 2)
        assert texts == _single_engine_texts(model)

        _kill_rank_1_under_load(head, old_remote[1], "lost: its connection closed")
        assert _success(head, 0) == 4 and _success(head, 1) == 2

        _wait_healthy(head, within=30)  # the node started a new core, which handshook again
        (new_remote,) = _core_pids(node.pid).items()
        assert new_remote[0] == 1 and new_remote[1] != old_remote[1]
        assert head.metric('pagellm:engine_restarts_total{engine="1"') == 1
        for prompt in PROMPTS[:2]:
            r = httpx.post(head.url + "/v1/completions", headers=_auth(head), timeout=60,
                           json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
        assert _success(head, 1) == 3  # rank 1 serves again

        assert _stop(node) == 0  # SIGTERM: the node stops its core and exits cleanly
        assert not psutil.pid_exists(new_remote[1])
    finally:
        if head is not None:
            head.stop()
        _stop(node)
    assert head.proc.returncode == 0


def test_a_headless_node_whose_config_differs_is_refused_naming_the_field(tiny_model) -> None:
    """The refused node exits 1 with the differing field named; the head waits on, and a
    node started with the head's flags is then accepted and served."""
    model = tiny_model("llama", max_position_embeddings=2048)
    port = _free_port_pair()
    bad = _headless(model, port, "--max-model-len", "512", stderr=subprocess.PIPE)
    good = None
    head = _head(model, port, wait=False)  # it answers /health once rank 1 is served
    try:
        _, log = bad.communicate(timeout=120)  # read as it runs: its cores log into the same pipe
        assert bad.returncode == 1
        assert ("the frontend refused its handshake: its config differs from the head's: "
                "max_model_len (head: 2048, rank 1: 512).") in log
        assert "The head refused engine core 1 (the reason is in its log above); this node stops." in log
        assert head.proc.poll() is None  # still waiting for a rank 1 it can serve

        good = _headless(model, port)
        head.wait_serving(120)
        r = httpx.post(head.url + "/v1/completions", headers=_auth(head), timeout=60,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        _stop(head.proc)
        for node in (bad, good):
            if node is not None:
                _stop(node)
    assert head.proc.returncode == 0 and good.returncode == 0


def test_a_start_rank_without_headless_is_a_clear_error() -> None:
    """A second node started without --headless would try to bind the head's ports."""
    r = subprocess.run([sys.executable, "-m", "pagellm", "serve", "m", "-dp", "2", "--data-parallel-size-local", "1",
                        "--data-parallel-address", "127.0.0.1", "--data-parallel-start-rank", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--data-parallel-start-rank is for --headless nodes (the head runs ranks from 0); add --headless." in r.stderr
