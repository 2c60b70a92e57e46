"""EngineCoreClient: how the frontend talks to engine cores.

InprocClient calls an EngineCore directly. The MP clients start engine-core processes,
bind a ROUTER (requests) and a PULL (outputs) socket, and exchange msgpack frames;
DPLBAsyncMPClient balances requests over several engines. All raise EngineDeadError
once an engine process is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.core import serial
from pagellm.core.engine_core_proc import HANDSHAKE_FAILED
from pagellm.core.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    engine_identity,
    rank_of_identity,
)
from pagellm.engine.exceptions import EngineDeadError, EngineStartupError
from pagellm.logger import init_logger

logger = init_logger(__name__)


class EngineCoreClient(ABC):
    """The frontend's view of the engine core(s). A client implements the sync API (for
    LLMEngine) or the async one (for AsyncLLM); the other half raises NotImplementedError.
    Subclasses keep these signatures exactly."""

    ready: EngineCoreReadyResponse

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, config: EngineConfig) -> EngineCoreClient:
        """The one factory: LLMEngine asks for the sync API, AsyncLLM for the async one."""
        if asyncio_mode:
            if not multiprocess_mode:
                raise ValueError("AsyncLLM needs the engine core in its own process.")
            return EngineCoreClient.make_async_mp_client(config)
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "LLM does not run data parallelism in one process. For offline data parallelism, "
                "start one process per rank, each with its own LLM(...) over a slice of the prompts "
                "(data_parallel_size=1), or serve with `pagellm serve --data-parallel-size N`."
            )
        if multiprocess_mode:
            return SyncMPClient(config)
        return InprocClient(config)

    @staticmethod
    def make_async_mp_client(config: EngineConfig) -> EngineCoreClient:
        pc = config.parallel_config
        if pc.data_parallel_size > 1:
            if pc.data_parallel_external_lb:
                return DPAsyncMPClient(config)
            return DPLBAsyncMPClient(config)
        return AsyncMPClient(config)

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def engine_dead(self) -> bool:
        """True once an engine core is gone (every later call raises EngineDeadError)."""
        return False

    # sync API
    def get_output(self) -> EngineCoreOutputs: raise NotImplementedError
    def add_request(self, request: EngineCoreRequest) -> None: raise NotImplementedError
    def abort_requests(self, request_ids: list[str]) -> None: raise NotImplementedError
    def call_utility(self, method: str, *args: Any) -> Any: raise NotImplementedError

    # async API
    async def get_output_async(self) -> EngineCoreOutputs: raise NotImplementedError
    async def add_request_async(self, request: EngineCoreRequest) -> None: raise NotImplementedError
    async def abort_requests_async(self, request_ids: list[str]) -> None: raise NotImplementedError
    async def call_utility_async(self, method: str, *args: Any, rank: int | None = None) -> Any:
        """Runs EngineCore.<method>(*args) on engine `rank` (None: the client decides)."""
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The engine core in this process: get_output() runs one step."""

    def __init__(self, config: EngineConfig):
        from pagellm.core.engine_core import EngineCore

        self.engine_core = EngineCore(config)
        self.ready = self.engine_core.ready_response()

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs.get(0) or EngineCoreOutputs()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# ---------------------------------------------------------------------------------------
# Engine processes


@dataclass
class _BackgroundResources:
    """Everything the finalizer must release; holds no reference to the client."""

    ctx: zmq.Context | None = None
    sockets: list = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    tmpdir: str | None = None
    engine_dead: bool = False
    shutdown_event: threading.Event = field(default_factory=threading.Event)

    def __call__(self) -> None:
        self.shutdown_event.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close(linger=0)
        if self.tmpdir:
            import shutil

            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _launch_engines(config: EngineConfig, ranks: Sequence[int], input_addr: str, output_addr: str) -> list[subprocess.Popen]:
    payload = pickle.dumps(config)  # process bootstrap over a pipe, never over ZMQ
    procs = []
    for rank in ranks:
        cmd = [
            sys.executable, "-m", "pagellm.core.engine_core_proc",
            "--input-address", input_addr, "--output-address", output_addr,
            "--rank", str(rank), "--parent-pid", str(os.getpid()),
        ]
        # The engine inherits the OpenMP settings as they are: libgomp's default (idle
        # threads spin a while, then sleep) matches in-process speed, while PASSIVE
        # (sleep at once) cost 11% on workload V and ACTIVE (spin forever) starves the
        # frontend's threads on a small machine.
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
        procs.append(proc)
    return procs


def _wait_for_ready(sock: zmq.Socket, procs: dict[int, subprocess.Popen]) -> dict[int, EngineCoreReadyResponse]:
    """Waits for every engine's first frame (READY or FAILED), watching the processes."""
    ready: dict[int, EngineCoreReadyResponse] = {}
    deadline = time.monotonic() + envs.PAGELLM_ENGINE_READY_TIMEOUT_S
    while len(ready) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError("Timed out waiting for the engine core to start.")
        if sock.poll(100):
            frames = sock.recv_multipart()
            rank = rank_of_identity(frames[0])
            if frames[1] == HANDSHAKE_FAILED:
                raise EngineStartupError(f"Engine core initialization failed: {frames[2].decode()}")
            ready[rank] = serial.ready_decoder.decode(frames[1])
            continue
        for rank, proc in procs.items():
            if rank not in ready and proc.poll() is not None:
                # It may have sent FAILED just before exiting: look once more.
                if sock.poll(200):
                    continue
                raise EngineStartupError(
                    f"Engine core initialization failed: process (rank {rank}) exited with code "
                    f"{proc.returncode}. See its log above."
                )
    return ready


def merge_ready_responses(readies: dict[int, EngineCoreReadyResponse]) -> EngineCoreReadyResponse:
    """One response for the frontend from every rank's: each engine has its own KV pool,
    and the frontend reports the smallest (what every engine holds at least)."""
    return EngineCoreReadyResponse(num_gpu_blocks=min(r.num_gpu_blocks for r in readies.values()))


class MPClient(EngineCoreClient):
    """Starts engine processes for `ranks` and holds the sockets; subclasses add IO."""

    def __init__(self, config: EngineConfig, ranks: Sequence[int], asyncio_mode: bool):
        self.config = config
        self.ranks = list(ranks)
        self.resources = _BackgroundResources()
        self._finalizer = weakref.finalize(self, self.resources)
        try:
            self._start(asyncio_mode)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, asyncio_mode: bool) -> None:
        res = self.resources
        res.tmpdir = tempfile.mkdtemp(prefix="pagellm-")
        input_addr = f"ipc://{res.tmpdir}/input.sock"
        output_addr = f"ipc://{res.tmpdir}/output.sock"
        self.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        res.ctx = self.ctx
        # Handshake on a plain sync socket; async sockets are made on the same address after.
        sync_ctx = zmq.Context.instance()
        self.input_socket = sync_ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(input_addr)
        res.sockets.append(self.input_socket)
        self.output_addr = output_addr
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(output_addr)
        res.sockets.append(self.output_socket)

        res.procs = _launch_engines(self.config, self.ranks, input_addr, output_addr)
        self.procs = dict(zip(self.ranks, res.procs))
        self.ready = merge_ready_responses(_wait_for_ready(self.input_socket, self.procs))
        self.identities = {rank: engine_identity(rank) for rank in self.ranks}
        self._start_monitor()

    def _start_monitor(self) -> None:
        res = self.resources
        procs = list(res.procs)
        on_dead_ref = weakref.WeakMethod(self._on_engine_dead)  # the thread must not keep us alive

        def monitor() -> None:
            while not res.shutdown_event.is_set():
                for proc in procs:
                    if proc.poll() is not None and not res.shutdown_event.is_set():
                        res.engine_dead = True
                        logger.error("Engine core process %d died (exit code %s).", proc.pid, proc.returncode)
                        on_dead = on_dead_ref()
                        if on_dead is not None:
                            on_dead()
                        return
                time.sleep(0.05)

        threading.Thread(target=monitor, daemon=True, name="EngineMonitor").start()

    def _on_engine_dead(self) -> None: ...

    @property
    def engine_dead(self) -> bool:
        return self.resources.engine_dead

    @property
    def engine_pids(self) -> list[int]:
        return [p.pid for p in self.resources.procs]

    def ensure_alive(self) -> None:
        if self.engine_dead:
            raise EngineDeadError()

    def _send(self, rank: int, req_type: EngineCoreRequestType, payload: Any) -> None:
        self.ensure_alive()
        self.input_socket.send_multipart([self.identities[rank], req_type.value, serial.encode(payload)])

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """For LLM: a thread reads the output socket into a queue; get_output() blocks on it."""

    def __init__(self, config: EngineConfig):
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        super().__init__(config, [0], asyncio_mode=False)
        # The thread gets locals only, so the client can still be garbage-collected.
        args = (self.resources, self.output_socket, self.outputs_queue, self.utility_results)
        threading.Thread(target=_sync_output_loop, args=args, daemon=True, name="EngineOutputs").start()

    def _on_engine_dead(self) -> None:
        self.outputs_queue.put(EngineDeadError())
        for fut in self.utility_results.values():
            if not fut.done():
                fut.set_exception(EngineDeadError())

    def get_output(self) -> EngineCoreOutputs:
        out = self.outputs_queue.get()
        if isinstance(out, Exception):
            self.outputs_queue.put(out)  # every later caller sees it too
            raise out
        return out

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            self._send(0, EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            with self._lock:
                self._send(0, EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut: Future = Future()
        self.utility_results[call_id] = fut
        with self._lock:
            self._send(0, EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return fut.result()


def _sync_output_loop(res: _BackgroundResources, sock: zmq.Socket, outq: queue.Queue, utility: dict) -> None:
    while not res.shutdown_event.is_set():
        try:
            if not sock.poll(100):
                continue
            frame = sock.recv(copy=False)
        except zmq.ZMQError:
            return
        outputs = _decode_frame(frame, res, utility)
        if outputs is _DEAD:
            outq.put(EngineDeadError())
            return
        if outputs is not None:
            outq.put(outputs)


_DEAD: Any = object()


def _decode_frame(frame: Any, res: _BackgroundResources, utility: dict) -> Any:
    """One output frame -> EngineCoreOutputs; _DEAD for the dead sentinel (and marks the
    engine dead); None for a utility reply, which resolves its future here."""
    if bytes(frame.buffer) == ENGINE_CORE_DEAD:
        res.engine_dead = True
        return _DEAD
    outputs = serial.outputs_decoder.decode(frame.buffer)
    if outputs.utility_output is not None:
        _resolve_utility(utility, outputs.utility_output)
        return None
    return outputs


def _resolve_utility(futures: dict[int, Any], out: Any) -> None:
    fut = futures.pop(out.call_id, None)
    if fut is None or fut.done():
        return
    if out.failure_message is not None:
        fut.set_exception(RuntimeError(out.failure_message))
    else:
        fut.set_result(out.result)


class AsyncMPClient(MPClient):
    """For AsyncLLM: an asyncio task reads outputs into an asyncio.Queue."""

    def __init__(self, config: EngineConfig, ranks: Sequence[int] = (0,)):
        self.outputs_queue: asyncio.Queue | None = None
        self.utility_results: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        super().__init__(config, ranks, asyncio_mode=True)

    def _ensure_output_task(self) -> None:
        if self._output_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.outputs_queue = asyncio.Queue()
        self._output_task = self._loop.create_task(self._output_loop())
        if self.resources.engine_dead:
            self._on_engine_dead()

    async def _output_loop(self) -> None:
        assert self.outputs_queue is not None
        res, sock, outq = self.resources, self.output_socket, self.outputs_queue
        while True:
            frame = await sock.recv(copy=False)
            outputs = _decode_frame(frame, res, self.utility_results)
            if outputs is _DEAD:
                outq.put_nowait(EngineDeadError())
                return
            if outputs is None:
                continue
            self._on_outputs(outputs)
            outq.put_nowait(outputs)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None: ...

    def _on_engine_dead(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def wake() -> None:
            if self.outputs_queue is not None:
                self.outputs_queue.put_nowait(EngineDeadError())
            for fut in self.utility_results.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError())

        loop.call_soon_threadsafe(wake)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_output_task()
        assert self.outputs_queue is not None
        out = await self.outputs_queue.get()
        if isinstance(out, Exception):
            self.outputs_queue.put_nowait(out)
            raise out
        return out

    def _choose_rank(self, request: EngineCoreRequest) -> int:
        return self.ranks[0]

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_output_task()
        self._send(self._choose_rank(request), EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            for rank, ids in self._group_aborts(request_ids).items():
                self._send(rank, EngineCoreRequestType.ABORT, ids)

    def _group_aborts(self, request_ids: list[str]) -> dict[int, list[str]]:
        return {self.ranks[0]: list(request_ids)}

    async def call_utility_async(self, method: str, *args: Any, rank: int | None = None) -> Any:
        self._ensure_output_task()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self.utility_results[call_id] = fut
        self._send(self.ranks[0] if rank is None else rank, EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return await fut

    def shutdown(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            try:
                self._output_task.cancel()
            except RuntimeError:
                pass  # loop already closed
        super().shutdown()


class DPAsyncMPClient(AsyncMPClient):
    """One data-parallel rank (given by data_parallel_rank); an external router balances."""

    def __init__(self, config: EngineConfig):
        rank = config.parallel_config.data_parallel_rank or 0
        super().__init__(config, ranks=(rank,))


class DPLBAsyncMPClient(AsyncMPClient):
    """N engine processes; each request goes to the least-loaded engine."""

    def __init__(self, config: EngineConfig):
        n = config.parallel_config.data_parallel_size
        self.reqs_in_flight: dict[str, int] = {}
        self.in_flight_counts: dict[int, int] = dict.fromkeys(range(n), 0)
        self.waiting_counts: dict[int, int] = dict.fromkeys(range(n), 0)
        self.requests_sent: dict[int, int] = dict.fromkeys(range(n), 0)
        self._rr = 0
        super().__init__(config, ranks=range(n))

    async def call_utility_async(self, method: str, *args: Any, rank: int | None = None) -> Any:
        """Without a rank, every engine runs it (reset_prefix_cache must empty every
        engine's cache); the first engine's result is returned."""
        if rank is not None:
            return await super().call_utility_async(method, *args, rank=rank)
        results = await asyncio.gather(*(super(DPLBAsyncMPClient, self).call_utility_async(method, *args, rank=r)
                                         for r in self.ranks))
        return results[0]

    def _choose_rank(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            rank = request.data_parallel_rank
            if rank not in self.in_flight_counts:
                raise ValueError(f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)}).")
        else:
            # Least loaded by in-flight + waiting; start from a rotating offset for ties.
            n = len(self.ranks)
            order = [(self._rr + i) % n for i in range(n)]
            self._rr = (self._rr + 1) % n
            rank = min(order, key=lambda r: self.in_flight_counts[r] + self.waiting_counts[r])
        self.reqs_in_flight[request.request_id] = rank
        self.in_flight_counts[rank] += 1
        self.requests_sent[rank] += 1
        return rank

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.waiting_counts[outputs.engine_index] = outputs.scheduler_stats.num_waiting_reqs
        for req_id in outputs.finished_requests or ():
            rank = self.reqs_in_flight.pop(req_id, None)
            if rank is not None:
                self.in_flight_counts[rank] -= 1

    def _group_aborts(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for req_id in request_ids:
            rank = self.reqs_in_flight.get(req_id)
            if rank is not None:
                groups.setdefault(rank, []).append(req_id)
        return groups

