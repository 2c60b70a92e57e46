"""Tensor parallelism (pagellm/core/tensor_parallel.py): two ranks as two real
processes in a gloo group, the engine core in its own process (the default LLM), against
one rank on the same model. On the exact paths (float32 weights and activations; GGUF
blocks with float32 activations) every logprob the engine returns, prompt and sampled,
is one rank's within 1e-5 (relative, above 1) and the greedy tokens are equal; on GGUF's int8-activation path
the tokens are equal and the logprobs within 1e-3 (the ranks sum partial products in
another order, and a rounded activation can move)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.exceptions import EngineDeadError, EngineStartupError
from pagellm.model_executor.parallel_state import TensorParallelGroup
from tests.utils import token_ids

PROMPTS = [token_ids(n, offset) for n, offset in ((23, 13), (7, 17), (40, 29))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)


def _run(model: str, tp: int, prompts: list[list[int]] = PROMPTS, **kwargs: Any) -> list[Any]:
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=128, block_size=16, seed=0,
              multiprocess_mode=tp > 1, **kwargs)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


def _logprob_gap(one: list[Any], two: list[Any]) -> float:
    """The largest difference between the runs' logprobs of the same token at the same
    position (prompt and sampled), relative to the logprob where that is above 1, after
    checking that both runs have the same tokens."""
    gap = 0.0
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True))
        pairs += list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True))
        for pa, pb in pairs:
            for token, lp in pa.items():
                if token in pb:
                    gap = max(gap, abs(lp.logprob - pb[token].logprob) / max(1.0, abs(lp.logprob)))
        # the prompt's own tokens are always in both: nothing above compared nothing
        assert len(pairs) == len(a.prompt_token_ids) - 1 + len(a.outputs[0].token_ids)
    return gap


@pytest.mark.parametrize("family,overrides", [
    ("llama", {"vocab_size": 49153}),  # tied head; a vocabulary two ranks split unevenly
    ("qwen3", {}),  # per-head q/k norms
    ("gemma3", {}),  # sliding and global layers, Gemma's extra norms
    ("phi3", {}),  # fused qkv / gate_up tensors cut into their parts, then into shards
    ("gemma2", {}),  # score caps, the final logits' cap after the gather
    ("smollm3", {}),  # a layer without rope
])
def test_two_ranks_match_one_on_float_weights(family: str, overrides: dict, tiny_model: Callable[..., str]) -> None:
    model = tiny_model(family, **overrides)
    one, two = _run(model, 1, dtype="float32"), _run(model, 2, dtype="float32")
    assert _logprob_gap(one, two) < 1e-5


@pytest.fixture(scope="module")
def tp_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Q4_K_M Llama whose shards cut K-quant rows on their 256-value blocks (hidden 512,
    8 heads of 64: o_proj's 512 columns and down_proj's 1024 split in two)."""
    from pagellm.benchmarks.synthetic_gguf import write_llama_gguf

    path = str(tmp_path_factory.mktemp("tp-gguf") / "tp-q4_k_m.gguf")
    write_llama_gguf(path, dict(hidden=512, inter=1024, layers=3, heads=8, kv_heads=4, vocab=512),
                     "q4_k_m", seed=1)
    return path


@pytest.mark.parametrize("activations,bound", [("float32", 1e-5), ("q8", 1e-3)])
def test_two_ranks_match_one_on_gguf_blocks(tp_gguf: str, activations: str, bound: float) -> None:
    prompts = [[t % 500 + 5 for t in p] for p in PROMPTS]  # the file's vocabulary of 512
    one = _run(tp_gguf, 1, prompts, gguf_activations=activations)
    two = _run(tp_gguf, 2, prompts, gguf_activations=activations)
    assert _logprob_gap(one, two) < bound


def test_bfloat16_activations_sum_through_gloo(tiny_model: Callable[..., str]) -> None:
    """bfloat16 activations are summed by gloo (the shared segment carries float32): the
    prompt's logprobs (the same tokens read in both runs) within bfloat16's rounding of one
    rank's."""
    model = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = []
    for tp in (1, 2):
        llm = LLM(model, tensor_parallel_size=tp, dtype="bfloat16", max_model_len=128, multiprocess_mode=tp > 1)
        try:
            outs.append(llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0])
        finally:
            llm.shutdown()
    one, two = ([next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs)
    assert len(one) == len(two) == len(PROMPTS[2]) - 1
    assert max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(one, two)) < 0.05


def test_unseeded_sampling_stays_in_step(tiny_model: Callable[..., str]) -> None:
    """Random draws with no seed: every rank samples the same tokens (a rank that drew
    others would stop the engine: 'the ranks' sequences differ'); with a seed, the same
    tokens again in a second run. (Not one rank's tokens: a random model's flat
    distribution turns the ranks' 1e-6 differences into a neighbouring token.)"""
    model = tiny_model("llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=7)
    llm = LLM(model, tensor_parallel_size=2, max_model_len=128, dtype="float32")
    try:
        out = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [24, 24, 24]
        runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
                for _ in range(2)]
    finally:
        llm.shutdown()
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3


def test_a_dead_rank_fails_the_engine_fast_and_leaves_no_process(tiny_model: Callable[..., str]) -> None:
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, max_model_len=128, dtype="float32")
    (core_pid,) = llm.llm_engine.engine_core.engine_pids
    (rank1,) = psutil.Process(core_pid).children()
    assert "pagellm.core.tensor_parallel" in rank1.cmdline()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    os.kill(rank1.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    assert time.monotonic() - start < 10.0
    llm.shutdown()
    assert not psutil.pid_exists(core_pid) or psutil.Process(core_pid).status() == psutil.STATUS_ZOMBIE


def test_shutdown_stops_every_rank(tiny_model: Callable[..., str]) -> None:
    llm = LLM(tiny_model("qwen3"), tensor_parallel_size=2, max_model_len=128, dtype="float32")
    (core_pid,) = llm.llm_engine.engine_core.engine_pids
    ranks = psutil.Process(core_pid).children()
    assert len(ranks) == 1
    llm.shutdown()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel_size": 3}, "num_attention_heads (4) does not divide into 3 equal shards"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
    ({"tensor_parallel_size": 2, "device": "cuda"}, "tensor parallelism runs on CPU (gloo)"),
    ({"tensor_parallel_size": 2, "data_parallel_backend": "ray"}, "not with --data-parallel-backend ray yet"),
    ({"tensor_parallel_size": 2, "speculative_config": {"model": "DRAFT", "num_speculative_tokens": 2}},
     "a draft model (speculative_config.model) is not supported with tensor parallelism"),
])
def test_refused_settings_say_why(kwargs: dict, message: str, tiny_model: Callable[..., str]) -> None:
    model = tiny_model("llama")
    spec = kwargs.get("speculative_config")
    if spec is not None:
        kwargs = {**kwargs, "speculative_config": {**spec, "model": model}}
    if kwargs.get("device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("device='cuda' is refused before tensor parallelism is checked on a machine without CUDA")
    with pytest.raises(ValueError) as e:
        EngineArgs(model=model, max_model_len=128, **kwargs).create_engine_config()
    assert message in str(e.value)


def test_families_whose_layers_do_not_split_are_refused(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM does not split across ranks yet"):
        EngineArgs(model=tiny_model("qwen3_moe"), tensor_parallel_size=2).create_engine_config()


def test_gguf_shards_must_fall_on_blocks(q4_k_m_file: str) -> None:
    """The tiny Q4_K_M file's o_proj has 256 columns: two ranks' halves of 128 would cut its
    256-value blocks. The engine does not start, and says so."""
    with pytest.raises(EngineStartupError, match=r"columns \[0, 128\) of Q4_K do not fall on its blocks of 256 values"):
        LLM(q4_k_m_file, tensor_parallel_size=2, max_model_len=128)


def test_shards_of_a_group() -> None:
    assert [TensorParallelGroup(r, 2).shard(8) for r in range(2)] == [(0, 4), (4, 4)]
    assert [TensorParallelGroup(r, 3).uneven_shard(10) for r in range(3)] == [(0, 4), (4, 4), (8, 2)]
    assert [TensorParallelGroup(r, 4).uneven_shard(5) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    with pytest.raises(ValueError, match="tensor parallel: heads 9 does not split into 2 equal parts"):
        TensorParallelGroup(0, 2).shard(9, "heads")
    with pytest.raises(ValueError, match="tensor parallel rank 2 is outside 0..1"):
        TensorParallelGroup(2, 2)


_RANK1 = """
import sys, torch
from pagellm.model_executor.parallel_state import init_tensor_parallel_group
from tests.distributed.test_tensor_parallel import collective_steps
collective_steps(init_tensor_parallel_group(1, 2, sys.argv[1], 60, sys.argv[2]))
"""


def collective_steps(group: TensorParallelGroup) -> None:
    """The same collectives on each rank, each larger than a slot of the shared segment
    (so in chunks), checked exactly: a sum, a gather, a broadcast; a gather whose rows are
    larger than a slot and bfloat16 through gloo."""
    import torch

    from pagellm.model_executor.parallel_state import SHM_SLOT_BYTES

    n = 2 * SHM_SLOT_BYTES // 4 + 5  # three chunks
    x = torch.arange(n, dtype=torch.float32) * (group.rank + 1)
    assert torch.equal(group.all_reduce(x), torch.arange(n, dtype=torch.float32) * 3)
    rows = torch.full((5, 300_000), float(group.rank))  # 6 MB: rows in chunks of 3
    gathered = group.all_gather(rows)
    assert gathered.shape == (5, 600_000)
    assert torch.equal(gathered[:, :300_000], torch.zeros(5, 300_000))
    assert torch.equal(gathered[:, 300_000:], torch.ones(5, 300_000))
    wide = torch.full((2, SHM_SLOT_BYTES // 4 + 1), float(group.rank))  # a row past a slot: gloo
    gathered = group.all_gather(wide)
    assert torch.equal(gathered, torch.cat([torch.zeros_like(wide), torch.ones_like(wide)], 1))
    payload = bytes(range(256)) * (9 * 4096)  # 9 MB
    assert group.broadcast_object(payload if group.rank == 0 else None) == payload
    half = torch.full((7,), 1.5, dtype=torch.bfloat16)
    assert torch.equal(group.all_reduce(half), torch.full((7,), 3.0, dtype=torch.bfloat16))


def test_shared_memory_collectives_between_processes(tmp_path: Any) -> None:
    import subprocess
    import sys

    from pagellm.model_executor.parallel_state import ShmChannel, init_tensor_parallel_group

    store, segment = str(tmp_path / "store"), str(tmp_path / "segment")
    ShmChannel.create(segment, 2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rank1 = subprocess.Popen([sys.executable, "-c", _RANK1, store, segment], cwd=root)
    try:
        group = init_tensor_parallel_group(0, 2, store, 60, segment)
        assert group.shm is not None
        collective_steps(group)
        assert rank1.wait(timeout=60) == 0
    finally:
        rank1.kill()


def test_a_server_restarts_an_engine_whose_rank_died(tiny_model: Callable[..., str]) -> None:
    """`pagellm serve -tp 2 --restart-engine-on-failure`: rank 1 killed under load fails the
    engine's streams with the 503 event within 2 s, and a new engine core (with a new rank
    1) serves within 30 s; the old engine core is gone."""
    import asyncio

    import httpx

    from tests.entrypoints.openai.conftest import ServerProcess
    from tests.entrypoints.openai.test_engine_restart import (
        BODY,
        _auth,
        _engine_pids,
        _kill_under_load,
        _wait_healthy,
    )

    model = tiny_model("llama", max_position_embeddings=2048)
    srv = ServerProcess("--model", model, "--max-model-len", "2048", "-tp", "2", "--restart-engine-on-failure")
    try:
        (core,) = _engine_pids(srv).values()
        (rank1,) = psutil.Process(core).children()
        results, killed_at = _kill_under_load(srv, rank1.pid, streams=3, max_tokens=2000, timeout=60)
        for res in results:
            assert res["done"] and res["error"]["code"] == 503
            assert res["error_at"] - killed_at < 2
        _wait_healthy(srv, within=30)
        (new_core,) = _engine_pids(srv).values()
        assert new_core != core
        assert not psutil.pid_exists(core) or psutil.Process(core).status() == psutil.STATUS_ZOMBIE
        assert len(psutil.Process(new_core).children()) == 1

        async def later() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=60) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json=BODY) for _ in range(4)])

        for r in asyncio.run(later()):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_the_segment_goes_where_it_has_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm when it holds twice the segment, else the temporary directory (a full
    tmpfs would kill a rank with SIGBUS at its first write)."""
    import tempfile

    from pagellm.core.tensor_parallel import shm_segment_path
    from pagellm.model_executor.parallel_state import ShmChannel

    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("this machine has no writable /dev/shm")
    need = ShmChannel.segment_bytes(2)

    class Fs:
        f_frsize = 4096

        def __init__(self, free: int) -> None:
            self.f_bavail = free // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Fs(2 * need + 4096))
    assert os.path.dirname(shm_segment_path(2)) == "/dev/shm"
    monkeypatch.setattr(os, "statvfs", lambda path: Fs(need))
    assert os.path.dirname(shm_segment_path(2)) == tempfile.gettempdir()
