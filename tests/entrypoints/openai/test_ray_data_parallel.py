"""`--data-parallel-backend ray` on a local Ray cluster of two raylets (one CPU each, every
address loopback, usage stats off, no dashboard): `pagellm serve -dp 2` places one engine
core actor on each raylet, requests land on both ranks with a single engine's greedy
text, a core actor killed under load fails its streams with the 503 event within 2 s
while the other rank finishes its own, and a new actor serves the rank again."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.entrypoints.openai.conftest import ServerProcess
from tests.entrypoints.openai.test_engine_restart import _auth, _wait_healthy
from tests.entrypoints.openai.test_multi_node import (
    PROMPTS,
    _kill_rank_1_under_load,
    _single_engine_texts,
    _success,
)
from tests.utils import import_benchmark

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="the Ray backend's tests need Ray (pip install 'pagellm[ray]')")

_free_port_pair = import_benchmark("compare").free_port_pair

# Ray's own settings for the test cluster and every process that joins it: no usage
# report, and this machine's loopback address as every node's (Ray's choice on macOS; read
# when ray is first imported, so the test imports it only after setting it).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
PLACED = re.compile(r"Engine core (\d+): Ray actor on node (\w+) \(([\d.]+)\), pid (\d+), (\d+) CPU")


@pytest.fixture(scope="module")
def ray_cluster():
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)  # the raylets inherit it
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    try:
        cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        assert cluster.address.startswith("127.0.0.1:")
        yield cluster
    finally:
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _placements(log: Path) -> list[tuple[int, str, str, int]]:
    """(rank, node id, node address, pid) of each actor the server started, in order."""
    return [(int(m[1]), m[2], m[3], int(m[4])) for m in PLACED.finditer(log.read_text())]


@needs_ray
def test_ray_backend_places_a_core_on_each_raylet_and_a_killed_actor_comes_back(
        ray_cluster, tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "1")  # a bundle of one CPU per rank: one per raylet
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    model = tiny_model("llama", max_position_embeddings=2048)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        srv = ServerProcess("--model", model, "-dp", "2", "--data-parallel-backend", "ray",
                            "--data-parallel-rpc-port", str(_free_port_pair()), "--max-model-len", "2048",
                            "--restart-engine-on-failure", stderr=log)
    try:
        placed = _placements(log_path)
        assert sorted(rank for rank, *_ in placed) == [0, 1]
        nodes = {rank: node for rank, node, _, _ in placed}
        assert nodes[0] != nodes[1]  # one core on each raylet
        assert set(nodes.values()) == {n.node_id for n in ray_cluster.list_all_nodes()}
        assert all(ip == "127.0.0.1" for _, _, ip, _ in placed)
        old_pid = dict((rank, pid) for rank, _, _, pid in placed)[1]

        # one request at a time: the balancer alternates, two on each rank
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(srv.url + "/v1/completions", headers=_auth(srv), timeout=60,
                           json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            texts.append(r.json()["choices"][0]["text"])
        assert (_success(srv, 0), _success(srv, 1)) == (2, 2)
        assert texts == _single_engine_texts(model)  # the mp backend's engine-core process

        _kill_rank_1_under_load(srv, old_pid, "its Ray actor died (its process or node died)")  # rank 1's actor
        assert _success(srv, 0) == 4 and _success(srv, 1) == 2

        _wait_healthy(srv, within=30)  # a new actor for rank 1 handshook
        new = [p for p in _placements(log_path)[2:] if p[0] == 1]
        assert len(new) == 1 and new[0][3] != old_pid
        assert new[0][1] == nodes[1]  # in rank 1's bundle, on the same raylet
        assert srv.metric('pagellm:engine_restarts_total{engine="1"') == 1
        for prompt in PROMPTS[:2]:
            r = httpx.post(srv.url + "/v1/completions", headers=_auth(srv), timeout=60,
                           json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
        assert _success(srv, 1) == 3  # rank 1 serves again
        live = [placed[0][3], new[0][3]]
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in live):
        assert time.monotonic() < deadline, "the engine core actors outlived the server"
        time.sleep(0.1)


@needs_ray
def test_a_lost_raylet_fails_its_ranks_requests_and_a_new_node_takes_the_rank(
        ray_cluster, tiny_model, monkeypatch) -> None:
    """A node's raylet killed (its workers go with it): Ray reports the actor dead, the
    rank's request fails with EngineRestartingError while the other rank's finishes, and the
    rank waits for room; a node that joins gets the rank's bundle and serves it."""
    from pagellm import AsyncLLM, SamplingParams
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.engine.exceptions import EngineRestartingError

    monkeypatch.setenv("PAGELLM_NUM_THREADS", "1")
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    model = tiny_model("llama", max_position_embeddings=2048)
    (worker,) = ray_cluster.worker_nodes

    async def main() -> None:
        llm = AsyncLLM.from_engine_args(EngineArgs(
            model=model, max_model_len=2048, data_parallel_size=2, data_parallel_backend="ray",
            data_parallel_rpc_port=_free_port_pair(), restart_engine_on_failure=True))
        try:
            llm.start()
            procs = llm.engine_core.resources.procs
            (lost,) = [rank for rank, proc in procs.items() if proc.node_id == worker.node_id]
            started = {rank: asyncio.Event() for rank in (0, 1)}

            async def generate(rank: int, max_tokens: int) -> int | BaseException:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                tokens = 0
                try:
                    async for out in llm.generate("Hello there", params, f"r{rank}-{max_tokens}",
                                                  data_parallel_rank=rank):
                        tokens = len(out.outputs[0].token_ids)
                        started[rank].set()
                except EngineRestartingError as e:
                    return e
                return tokens

            runs = {rank: asyncio.create_task(generate(rank, 1500)) for rank in (0, 1)}
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
            lost_at = time.monotonic()
            ray_cluster.remove_node(worker, allow_graceful=False)
            error = await asyncio.wait_for(runs[lost], 30)
            assert isinstance(error, EngineRestartingError)
            assert str(error) == ("The engine core serving this request died (its Ray actor died (its process "
                                  "or node died)) and is restarting; retry the request.")
            assert time.monotonic() - lost_at < 10
            assert await runs[1 - lost] == 1500  # the other rank's request finishes
            assert llm.restarting_engines == [lost]  # no room for its bundle until a node joins

            new = ray_cluster.add_node(**NODE_ARGS)
            deadline = time.monotonic() + 60
            while llm.restarting_engines:
                assert time.monotonic() < deadline, "the rank was not served again on the new node"
                await asyncio.sleep(0.1)
            assert procs[lost].node_id == new.node_id
            assert await generate(lost, 8) == 8
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_a_bad_data_parallel_backend_is_a_clear_error() -> None:
    r = subprocess.run([sys.executable, "-m", "pagellm", "serve", "m", "-dp", "2", "--data-parallel-backend", "rays"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "data_parallel_backend must be one of mp, ray; got 'rays'." in r.stderr
