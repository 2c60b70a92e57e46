"""EngineCoreClient: how the frontend talks to engine cores.

InprocClient calls an EngineCore directly. The MP clients start engine-core processes,
bind a ROUTER (requests) and a PULL (outputs) socket, and exchange msgpack frames;
DPLBAsyncMPClient balances requests over several engines. All raise EngineDeadError
once an engine process is gone, unless the async clients restart it
(restart_engine_on_failure): then the dead rank's in-flight requests fail, reported as an
EngineFailure among the outputs, and a new process takes the rank over.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import pickle
import queue
import subprocess
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.core import serial
from pagellm.core.protocol import (
    ENGINE_CORE_BEAT,
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    parse_engine_dead_frame,
    parse_heartbeat_frame,
)
from pagellm.engine.exceptions import EngineDeadError, EngineRestartingError, EngineStartupError
from pagellm.engine.handshake import (
    Handshake,
    HandshakeCheck,
    connected,
    engine_addresses,
    exited_early,
    pid_of_identity,
    read_handshake,
    send_stop,
    wait_for_ready,
)
from pagellm.engine.prestart import claim_prestarted, launch_engine_process, stop_engine_processes
from pagellm.logger import init_logger
from pagellm.utils import describe_exit

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
        if config.parallel_config.restart_engine_on_failure:
            raise ValueError(
                "restart_engine_on_failure applies to the server's engine (AsyncLLM); LLM "
                "raises EngineDeadError when its engine core dies."
            )
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "LLM does not run data parallelism in one process. For offline data parallelism, "
                "start one process per rank, each with its own LLM(...) over a slice of the prompts "
                "(data_parallel_size=1), or serve with `pagellm serve --data-parallel-size N`."
            )
        if config.parallel_config.data_parallel_address is not None:
            raise ValueError("LLM runs its engine core on this machine; engine cores on other nodes "
                             "(data_parallel_address) are served by `pagellm serve`.")
        if config.parallel_config.data_parallel_backend == "ray":
            raise ValueError("LLM runs its engine core in a process of its own; engine cores as Ray actors "
                             "(data_parallel_backend='ray') are served by `pagellm serve` (or AsyncLLM).")
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
    async def get_output_async(self) -> EngineCoreOutputs | EngineFailure:
        """The next outputs; an EngineFailure when a restarting client lost a rank."""
        raise NotImplementedError
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
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # rank -> its live process
    """(or, with data_parallel_backend='ray', its actor: a RayEngineProcess, Popen's methods)"""
    tmpdir: str | None = None
    ray: Any = None
    """The CoreEngineActorManager with data_parallel_backend='ray' (closed after the actors stop)."""
    engine_dead: bool = False
    shutdown_event: threading.Event = field(default_factory=threading.Event)
    hung: set = field(default_factory=set)
    """Processes the watchdog killed (it reported them; the monitor stays quiet). By the
    object, not the pid: Ray actors on different nodes may share a pid."""

    def __call__(self) -> None:
        self.shutdown_event.set()
        stop_engine_processes(list(self.procs.values()))
        if self.ray is not None:
            self.ray.close()
            self.ray = None
        for sock in self.sockets:
            sock.close(linger=0)
        if self.tmpdir:
            import shutil

            shutil.rmtree(self.tmpdir, ignore_errors=True)


def launch_engines(config: EngineConfig, ranks: Sequence[int], input_addr: str, output_addr: str) -> list[subprocess.Popen]:
    """Engine-core processes for `ranks`, each handed its config (the head's, or a
    --headless node's, pagellm/distributed/headless.py)."""
    procs = []
    for rank in ranks:
        proc = launch_engine_process(rank, input_addr, output_addr)  # + pagellm's OpenMP defaults
        send_config(proc, config)
        procs.append(proc)
    return procs


def send_config(proc: subprocess.Popen, config: EngineConfig) -> None:
    """Hands a started engine process its config (process bootstrap over a pipe to a
    child on this machine, never over ZMQ); it reads it once its imports are done."""
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()


def merge_ready_responses(readies: dict[int, EngineCoreReadyResponse]) -> EngineCoreReadyResponse:
    """One response for the frontend from every rank's: each engine has its own KV pool,
    and the frontend reports the smallest (what every engine holds at least)."""
    first = readies[min(readies)]  # every rank resolves the same quantization
    return EngineCoreReadyResponse(num_gpu_blocks=min(r.num_gpu_blocks for r in readies.values()),
                                   quantization=first.quantization)


def exit_cause(proc: Any) -> str:
    """How an engine core ended, in words: a process's exit status, or what a Ray actor
    (RayEngineProcess) says of its end."""
    return getattr(proc, "exit_cause", None) or describe_exit(proc.returncode)


class HangWatch:
    """The frontend's watchdog over its engine cores' heartbeats, the one liveness signal
    for hung cores and for cores on other nodes. A core is hung when it has sent no
    heartbeat for `timeout` seconds (stopped, frozen, or stuck holding the GIL), or when
    its heartbeats say it has work while its progress count (steps finished and model
    layers run) has stood still that long (a deadlock, a spinning kernel). A long step is
    not a hang: its layers move the count. timeout 0: never hung. A core on another node
    (`remote_ranks`), which has no process here to watch, is lost after `remote_timeout`
    seconds with no heartbeat and no output, whatever `timeout` is."""

    def __init__(self, timeout: float, ranks: Sequence[int], clock: Callable[[], float] = time.monotonic,
                 remote_ranks: Sequence[int] = (), remote_timeout: float = 0.0):
        self.timeout = timeout
        self.clock = clock
        self.remote = frozenset(remote_ranks)
        self.silence = {rank: remote_timeout if rank in self.remote else timeout for rank in ranks}
        now = clock()
        self.heard_at = dict.fromkeys(ranks, now)
        self.progress: dict[int, int | None] = dict.fromkeys(ranks)
        self.moved_at = dict.fromkeys(ranks, now)  # when the count last moved, or work began
        self.busy = dict.fromkeys(ranks, False)
        self.checked_at = now

    def reset(self, rank: int) -> None:
        """A new process serves `rank` (after a restart): nothing heard from it is old."""
        now = self.clock()
        self.heard_at[rank] = self.moved_at[rank] = now
        self.progress[rank], self.busy[rank] = None, False

    def alive(self, rank: int) -> None:
        """Output from `rank` arrived: a step (or a call) finished, so it is alive and
        moving (its heartbeats may queue behind outputs on a network)."""
        if rank in self.heard_at:
            self.heard_at[rank] = self.moved_at[rank] = self.clock()

    def beat(self, frame: bytes) -> None:
        rank, progress, busy = parse_heartbeat_frame(frame)
        if rank not in self.heard_at:
            return
        now = self.clock()
        self.heard_at[rank] = now
        if progress != self.progress[rank] or not self.busy[rank]:
            self.moved_at[rank] = now  # idle time is not stalled time
        self.progress[rank], self.busy[rank] = progress, busy

    def hung(self, ranks: Sequence[int]) -> list[tuple[int, str]]:
        """(rank, cause) of each of `ranks` that is hung now."""
        limits = [limit for limit in self.silence.values() if limit]
        if not limits:
            return []
        now = self.clock()
        if now - self.checked_at > min(limits) / 2:
            # This process was not listening (its own loop blocked, the machine paused):
            # the silence is ours; judge from now on.
            for rank in self.heard_at:
                self.heard_at[rank] = self.moved_at[rank] = now
        self.checked_at = now
        found = []
        for rank in ranks:
            silence = self.silence[rank]
            if silence and now - self.heard_at[rank] > silence:
                what = "lost" if rank in self.remote else "hung"
                found.append((rank, f"{what}: no heartbeat for {silence:g} s"))
            elif self.timeout and self.busy[rank] and now - self.moved_at[rank] > self.timeout:
                found.append((rank, f"hung: no progress for {self.timeout:g} s with work to do"))
        return found


def _kill_hung(res: _BackgroundResources, rank: int, cause: str) -> subprocess.Popen:
    """Ends a hung engine process (SIGKILL ends a stopped one too), said once in the log."""
    proc = res.procs[rank]
    res.hung.add(proc)
    logger.error("Engine core %d (pid %d) is %s; killing it.", rank, proc.pid, cause)
    if proc.poll() is None:
        proc.kill()
    return proc


class MPClient(EngineCoreClient):
    """Serves `ranks`: starts the engine processes of those this node runs
    (ParallelConfig.local_ranks), waits for every rank's accepted handshake (the others
    come from --headless nodes over TCP) and holds the sockets; subclasses add IO."""

    def __init__(self, config: EngineConfig, ranks: Sequence[int], asyncio_mode: bool):
        self.config = config
        self.ranks = list(ranks)
        self.local_ranks = [r for r in self.ranks if r in config.parallel_config.local_ranks]
        self.resources = _BackgroundResources()
        self._finalizer = weakref.finalize(self, self.resources)
        try:
            self._start(asyncio_mode)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, asyncio_mode: bool) -> None:
        res, pc = self.resources, self.config.parallel_config
        if pc.data_parallel_backend == "ray":
            from pagellm.distributed.ray_engines import CoreEngineActorManager

            res.ray = CoreEngineActorManager(self.config)
            # at exit, stop the actors before Ray's own exit hook (registered by now) leaves the cluster
            atexit.register(self._finalizer)
            if pc.data_parallel_address is None:  # the actors connect to this node's address
                pc = dataclasses.replace(pc, data_parallel_address=res.ray.frontend_host())
        tcp = pc.data_parallel_address is not None
        prestarted = claim_prestarted() if self.local_ranks == [0] == self.ranks and not tcp else None
        if prestarted:
            res.tmpdir = prestarted.tmpdir
            res.procs = {0: prestarted.proc}  # released by the finalizer from here on
        elif not tcp:
            res.tmpdir = tempfile.mkdtemp(prefix="pagellm-")
        self.input_addr, self.output_addr = engine_addresses(pc, res.tmpdir)
        self.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        res.ctx = self.ctx
        # Handshake on a plain sync socket; async sockets are made on the same address after.
        sync_ctx = zmq.Context.instance()
        self.input_socket = sync_ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        res.sockets.append(self.input_socket)
        self.output_socket = self.ctx.socket(zmq.PULL)
        res.sockets.append(self.output_socket)
        for sock, addr in ((self.input_socket, self.input_addr), (self.output_socket, self.output_addr)):
            sock.setsockopt(zmq.IPV6, 1)  # an IPv6 --data-parallel-address (IPv4 still works)
            try:
                sock.bind(addr)
            except zmq.ZMQError as e:
                raise EngineStartupError(f"Cannot bind the engine socket {addr}: {e} (--data-parallel-address "
                                         "must be this machine's; --data-parallel-rpc-port and the next port free).") from None

        if prestarted:
            send_config(prestarted.proc, self.config)
        else:
            res.procs = dict(zip(self.local_ranks, self._launch(self.local_ranks)))
        self.check = HandshakeCheck(pc.data_parallel_size, self.config.fingerprint(),
                                    {rank: proc.pid for rank, proc in res.procs.items()})
        accepted = wait_for_ready(self.input_socket, self.check, self.ranks, res.procs, self.input_addr,
                                  envs.PAGELLM_ENGINE_READY_TIMEOUT_S)
        self.ready = merge_ready_responses({rank: response for rank, (_, response) in accepted.items()})
        self.identities = {rank: identity for rank, (identity, _) in accepted.items()}
        remote = [r for r in self.ranks if r not in self.local_ranks]
        if res.ray is not None:
            logger.info("Engine cores %s (Ray actors) joined at %s.", self.ranks, self.input_addr)
        if remote:
            logger.info("Engine cores %s of other nodes joined at %s.", remote, self.input_addr)
        self.watch = HangWatch(pc.engine_iteration_timeout_s, self.ranks, remote_ranks=remote,
                               remote_timeout=envs.PAGELLM_REMOTE_ENGINE_TIMEOUT_S)
        self._start_monitor()

    def _launch(self, ranks: Sequence[int]) -> list[subprocess.Popen]:
        """Engine cores for `ranks`: processes, or Ray actors (data_parallel_backend='ray')."""
        if self.resources.ray is not None:
            return self.resources.ray.launch(ranks, self.input_addr, self.output_addr)
        return launch_engines(self.config, ranks, self.input_addr, self.output_addr)

    def _start_monitor(self) -> None:
        res = self.resources
        on_exit_ref = weakref.WeakMethod(self._on_process_exit)  # the thread must not keep us alive

        def monitor() -> None:
            reported: set = set()  # processes (by identity, as res.hung)
            while not res.shutdown_event.is_set():
                for rank, proc in list(res.procs.items()):
                    if (proc in reported or proc in res.hung or proc.poll() is None
                            or res.shutdown_event.is_set()):
                        continue
                    reported.add(proc)
                    cause = exit_cause(proc)
                    logger.error("Engine core %d (pid %d) died: %s.", rank, proc.pid, cause)
                    on_exit = on_exit_ref()
                    if on_exit is None or not on_exit(rank, proc, cause):
                        return
                time.sleep(0.05)

        threading.Thread(target=monitor, daemon=True, name="EngineMonitor").start()

    def _on_process_exit(self, rank: int, proc: subprocess.Popen, cause: str) -> bool:
        """Called from the monitor thread when an engine process ends; returns whether to
        keep watching. Here: the whole engine is dead."""
        self.resources.engine_dead = True
        self._on_engine_dead()
        return False

    def _on_engine_dead(self) -> None: ...

    @property
    def engine_dead(self) -> bool:
        return self.resources.engine_dead

    @property
    def engine_pids(self) -> list[int]:
        """The engine-core processes this node runs (not those of other nodes)."""
        return [self.resources.procs[rank].pid for rank in self.local_ranks]

    def ensure_alive(self) -> None:
        if self.engine_dead:
            raise EngineDeadError()

    def _send(self, rank: int, req_type: EngineCoreRequestType, payload: Any) -> None:
        self.ensure_alive()
        try:
            self.input_socket.send_multipart([self.identities[rank], req_type.value, serial.encode(payload)])
        except zmq.ZMQError as e:  # EHOSTUNREACH: the rank's process is gone, not yet noticed
            raise self._unreachable(rank) from e

    def _unreachable(self, rank: int) -> EngineDeadError:
        return EngineDeadError(f"Engine core {rank} is not reachable.")

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
        args = (self.resources, self.output_socket, self.outputs_queue, self.utility_results, self.watch)
        threading.Thread(target=_sync_output_loop, args=args, daemon=True, name="EngineOutputs").start()

    def _on_engine_dead(self) -> None:
        _fail_sync_callers(self.outputs_queue, self.utility_results, EngineDeadError())

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


def _fail_sync_callers(outq: queue.Queue, utility: dict, error: EngineDeadError) -> None:
    """The sync client's callers learn the engine is dead: the next get_output() and every
    pending utility call raise."""
    outq.put(error)
    for fut in utility.values():
        if not fut.done():
            fut.set_exception(EngineDeadError())


def _sync_output_loop(res: _BackgroundResources, sock: zmq.Socket, outq: queue.Queue, utility: dict,
                      watch: HangWatch) -> None:
    while not res.shutdown_event.is_set():
        for rank, cause in watch.hung(list(res.procs)):
            try:
                _kill_hung(res, rank, cause).wait(timeout=5)  # gone before the caller hears
            except subprocess.TimeoutExpired:
                pass
            res.engine_dead = True
            _fail_sync_callers(outq, utility, EngineDeadError(f"Engine core {rank} was {cause} and has been killed."))
            return
        try:
            if not sock.poll(100):
                continue
            frame = sock.recv(copy=False)
        except zmq.ZMQError:
            return
        outputs = _decode_frame(frame, utility, watch)
        if isinstance(outputs, EngineFailure):
            logger.error("Engine core %d failed: %s", outputs.rank, outputs.cause)
            res.engine_dead = True
            outq.put(EngineDeadError())
            return
        if outputs is not None:
            outq.put(outputs)


@dataclass
class EngineFailure:
    """An engine core died: its rank, the cause, and (from a restarting client, among the
    outputs) the ids of the requests that were in flight on it, which are lost."""

    rank: int
    cause: str
    request_ids: list[str] = field(default_factory=list)


def _decode_frame(frame: Any, utility: dict, watch: HangWatch) -> EngineCoreOutputs | EngineFailure | None:
    """One output frame -> EngineCoreOutputs; an EngineFailure for an engine's dead frame;
    None for a utility reply, which resolves its future here, and for a heartbeat, which
    goes to the watchdog."""
    buf = frame.buffer
    if buf[:len(ENGINE_CORE_BEAT)] == ENGINE_CORE_BEAT:  # a look at the prefix, no copy of the frame
        watch.beat(bytes(buf))
        return None
    if buf[:len(ENGINE_CORE_DEAD)] == ENGINE_CORE_DEAD:
        rank, cause = parse_engine_dead_frame(bytes(buf))  # type: ignore[misc]
        if rank not in watch.heard_at:
            logger.error("Ignored a dead frame for rank %d, which this server does not serve.", rank)
            return None
        return EngineFailure(rank, cause)
    try:
        outputs = serial.outputs_decoder.decode(buf)
    except msgspec.DecodeError as e:  # the output port is open to other nodes: a stray or skewed sender
        logger.error("Ignored an output frame that could not be read (%s).", e)
        return None
    if outputs.engine_index not in watch.heard_at:
        logger.error("Ignored outputs of rank %d, which this server does not serve.", outputs.engine_index)
        return None
    watch.alive(outputs.engine_index)
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
    """For AsyncLLM: an asyncio task reads outputs into an asyncio.Queue.

    It knows which rank runs each request (for the balancer, and so that a restarting
    client can fail exactly the requests a dead rank held). With
    restart_engine_on_failure, a dead rank is restarted in the background: its requests
    come out of get_output_async() as one EngineFailure, new requests go to the other
    ranks (none: EngineRestartingError), and the rank serves again once its new process
    has sent its handshake."""

    MAX_RESTART_ATTEMPTS = 3
    """Consecutive failed starts of a rank before the whole engine is declared dead."""

    STOP_RESEND_S = 60.0
    """How long a lost core of another node is told again to stop."""

    def __init__(self, config: EngineConfig, ranks: Sequence[int] = (0,)):
        self.outputs_queue: asyncio.Queue | None = None
        self.utility_results: dict[int, asyncio.Future] = {}
        self.utility_ranks: dict[int, int] = {}  # call id -> the rank that runs it
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.restart_on_failure = config.parallel_config.restart_engine_on_failure
        self.reqs_in_flight: dict[str, int] = {}  # request id -> rank
        self.in_flight_counts: dict[int, int] = dict.fromkeys(ranks, 0)
        self.restarting: set[int] = set()
        self.num_restarts: dict[int, int] = dict.fromkeys(ranks, 0)
        self._restart_tasks: set[asyncio.Task] = set()
        self._early_failures: list[tuple[int, subprocess.Popen, str]] = []  # before the loop is known
        self._handshake_waiters: dict[int, asyncio.Future] = {}  # local restarting rank -> its READY
        self._handshake_task: asyncio.Task | None = None
        # remote rank -> (identity, cause, until): a lost core told to stop, again every
        # watch tick for a while (a STOP sent into a dropped connection is lost with it)
        self._to_stop: dict[int, tuple[bytes, str, float]] = {}
        super().__init__(config, ranks, asyncio_mode=True)

    def _ensure_output_task(self) -> None:
        if self._output_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.outputs_queue = asyncio.Queue()
        self._output_task = self._loop.create_task(self._output_loop())
        self._watch_task = self._loop.create_task(self._watch_loop())
        self._handshake_task = self._loop.create_task(self._handshake_loop())
        if self.resources.engine_dead:
            self._on_engine_dead()
        for failure in self._early_failures:
            self._rank_died(*failure)
        self._early_failures.clear()

    def start(self) -> None:
        """Starts reading outputs now (the server calls it at start-up, so a dead engine
        is noticed and restarted before the first request)."""
        self._ensure_output_task()

    async def _output_loop(self) -> None:
        assert self.outputs_queue is not None
        res, sock, outq = self.resources, self.output_socket, self.outputs_queue
        while True:
            frame = await sock.recv(copy=False)
            outputs = _decode_frame(frame, self.utility_results, self.watch)
            if isinstance(outputs, EngineFailure):
                logger.error("Engine core %d failed: %s", outputs.rank, outputs.cause)
                if self._recovers(outputs.rank) and not res.engine_dead:
                    self._rank_died(outputs.rank, res.procs.get(outputs.rank), outputs.cause)
                    continue
                res.engine_dead = True
                outq.put_nowait(EngineDeadError())
                return
            if outputs is None:
                continue
            self._on_outputs(outputs)
            outq.put_nowait(outputs)

    async def _watch_loop(self) -> None:
        """The watchdog: a hung rank is killed, then handled as a death (restarted with
        restart_engine_on_failure, else the whole engine is dead). A lost rank of another
        node is told to stop (should it still run) and waited for again."""
        res = self.resources
        while not (res.engine_dead or res.shutdown_event.is_set()):
            await asyncio.sleep(0.25)
            self._stop_lost_cores()
            for rank in self.ranks:
                # a core of another node that died closed its connection: no need to wait
                # out the heartbeat's silence limit (kept for hangs and lost networks)
                if rank not in self.local_ranks and rank not in self.restarting and not self._connected(rank):
                    logger.error("Engine core %d (another node) is lost: its connection closed.", rank)
                    self._rank_died(rank, None, "lost: its connection closed")
            for rank, cause in self.watch.hung([r for r in self.ranks if r not in self.restarting]):
                if rank not in self.local_ranks:
                    logger.error("Engine core %d (another node) is %s.", rank, cause)
                    self._to_stop[rank] = (self.identities[rank], cause, time.monotonic() + self.STOP_RESEND_S)
                    self._stop_lost_cores()
                    self._rank_died(rank, None, cause)
                    continue
                proc = _kill_hung(res, rank, cause)
                if self.restart_on_failure:
                    self._rank_died(rank, proc, cause)
                    continue
                res.engine_dead = True
                self._on_engine_dead()
                return

    def _stop_lost_cores(self) -> None:
        """Tells each lost core of another node to stop (it may be alive behind a network
        that came back, heartbeating for a rank it no longer serves); again while its
        connection is up, for STOP_RESEND_S, since ZMQ drops what was queued for a
        connection that broke. Its node then starts a new core, which handshakes."""
        now = time.monotonic()
        for rank, (identity, cause, until) in list(self._to_stop.items()):
            try:
                self.input_socket.send_multipart([identity, EngineCoreRequestType.STOP.value,
                                                  serial.encode((cause, False))])
            except zmq.ZMQError:  # not connected (gone, or not back yet)
                pass
            if now > until:
                del self._to_stop[rank]

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        for req_id in outputs.finished_requests or ():
            rank = self.reqs_in_flight.pop(req_id, None)
            if rank is not None:
                self.in_flight_counts[rank] -= 1

    # -- engine death and restart ---------------------------------------------------------

    def _recovers(self, rank: int) -> bool:
        """Whether a death of `rank` costs only its requests: with restart_engine_on_failure,
        and always for a rank of another node (its node starts it again)."""
        return self.restart_on_failure or rank not in self.local_ranks

    def _on_process_exit(self, rank: int, proc: subprocess.Popen, cause: str) -> bool:
        if not self.restart_on_failure:
            return super()._on_process_exit(rank, proc, cause)
        loop = self._loop
        if loop is None:
            self._early_failures.append((rank, proc, cause))
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._rank_died, rank, proc, cause)
        return True

    def _rank_died(self, rank: int, proc: subprocess.Popen | None, cause: str) -> None:
        """In the event loop: fail what `rank` held and start its restart (once per death:
        the dead frame and the process exit both report it)."""
        res = self.resources
        if rank in self.restarting or res.engine_dead or res.shutdown_event.is_set():
            return
        if proc is not None and res.procs.get(rank) is not proc:
            return  # an older process of a rank that has restarted since
        self.restarting.add(rank)
        self.num_restarts[rank] += 1
        lost = [req_id for req_id, r in self.reqs_in_flight.items() if r == rank]
        for req_id in lost:
            del self.reqs_in_flight[req_id]
        self.in_flight_counts[rank] = 0
        self._forget_rank(rank)
        for call_id in [c for c, r in self.utility_ranks.items() if r == rank]:
            fut = self.utility_results.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineRestartingError(f"Engine core {rank} died ({cause}) and is restarting."))
        assert self.outputs_queue is not None and self._loop is not None
        self.outputs_queue.put_nowait(EngineFailure(rank, cause, lost))
        if rank not in self.local_ranks:
            logger.info("Rank %d is served again once its node has started a new engine core.", rank)
            return
        task = self._loop.create_task(self._restart(rank))
        self._restart_tasks.add(task)
        task.add_done_callback(self._restart_tasks.discard)

    def _forget_rank(self, rank: int) -> None:
        """Balancer state of a dead rank (the DP client keeps some)."""

    async def _restart(self, rank: int) -> None:
        res = self.resources
        started = time.monotonic()
        old = res.procs[rank]
        if old.poll() is None:  # it sent its dead frame and is on its way out
            old.kill()
        while old.poll() is None:
            await asyncio.sleep(0.02)
        for attempt in range(1, self.MAX_RESTART_ATTEMPTS + 1):
            if res.shutdown_event.is_set():
                return
            try:  # a Ray actor takes a moment to place: off the event loop
                (proc,) = await asyncio.to_thread(self._launch, [rank])
            except EngineStartupError as e:
                logger.error("Engine core %d restart attempt %d failed: %s", rank, attempt, e)
                await asyncio.sleep(min(2.0**attempt, 10.0))
                continue
            if res.shutdown_event.is_set():  # the client shut down meanwhile: not one of its cores
                stop_engine_processes([proc])
                return
            res.procs[rank] = proc
            self.check.local_pids[rank] = proc.pid
            try:
                await self._await_handshake(rank, proc)
            except (EngineStartupError, TimeoutError) as e:
                logger.error("Engine core %d restart attempt %d failed: %s", rank, attempt, e)
                if proc.poll() is None:
                    proc.kill()
                await asyncio.sleep(min(2.0**attempt, 10.0))
                continue
            self.watch.reset(rank)
            self.restarting.discard(rank)
            logger.info("Engine core %d restarted (pid %d) in %.1f s; restarts of this rank: %d.",
                        rank, proc.pid, time.monotonic() - started, self.num_restarts[rank])
            return
        logger.error("Engine core %d could not be restarted after %d attempts; the engine is dead.",
                     rank, self.MAX_RESTART_ATTEMPTS)
        res.engine_dead = True
        self._on_engine_dead()

    async def _await_handshake(self, rank: int, proc: subprocess.Popen) -> None:
        """Waits for the new process's accepted READY (the handshake loop delivers it),
        watching the process."""
        assert self._loop is not None
        waiter = self._handshake_waiters[rank] = self._loop.create_future()
        deadline = time.monotonic() + envs.PAGELLM_ENGINE_READY_TIMEOUT_S
        exited_at: float | None = None
        try:
            while not waiter.done():
                if proc.poll() is not None:  # a FAILED frame sent just before exiting may still come
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 0.2:
                        raise exited_early(rank, proc.returncode)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Timed out waiting for engine core {rank} to start.")
                await asyncio.sleep(0.05)
            waiter.result()
        finally:
            self._handshake_waiters.pop(rank, None)

    async def _handshake_loop(self) -> None:
        """Reads every handshake on the ROUTER (this loop's thread is the socket's only
        user): a restarted local core's READY, a core of another node joining again, or a
        core to refuse."""
        res = self.resources
        while not res.shutdown_event.is_set():
            while self.input_socket.poll(0):
                hs = read_handshake(self.input_socket)
                if hs is not None:
                    self._on_handshake(hs)
            await asyncio.sleep(0.05)

    def _on_handshake(self, hs: Handshake) -> None:
        rank = hs.rank
        waiter = self._handshake_waiters.get(rank)
        if waiter is not None and waiter.done():
            waiter = None
        if hs.response is None:
            if waiter is not None and pid_of_identity(hs.identity) == self.check.local_pids.get(rank):
                waiter.set_exception(hs.startup_error())
            else:
                logger.error("Engine core %d (another node) failed to start: %s", rank, hs.failure)
            return
        taken = rank in self.identities and rank not in self.restarting
        if taken and rank not in self.local_ranks and not self._connected(rank):
            # a new core of another node whose predecessor's connection has closed (it
            # died) before the watch said so: the rank changes hands
            self._rank_died(rank, None, "lost: its connection closed")
            taken = False
        reason = self.check.refusal(hs.identity, hs.response, taken=taken)
        if reason is not None:
            logger.error("Refused an engine core for rank %d: %s", rank, reason)
            send_stop(self.input_socket, hs.identity, reason, refused=True)
            if waiter is not None and pid_of_identity(hs.identity) == self.check.local_pids.get(rank):
                waiter.set_exception(EngineStartupError(f"Engine core {rank} was refused: {reason}"))
            return
        self.identities[rank] = hs.identity
        self._to_stop.pop(rank, None)
        if waiter is not None:
            waiter.set_result(hs.response)
        elif rank not in self.local_ranks:
            self.watch.reset(rank)
            self.restarting.discard(rank)
            logger.info("Engine core %d (another node) joined again; serving it.", rank)

    def _connected(self, rank: int) -> bool:
        """Whether the serving core of `rank` is still connected."""
        return connected(self.input_socket, self.identities[rank])

    def _unreachable(self, rank: int) -> EngineDeadError:
        if self._recovers(rank):
            return EngineRestartingError(f"Engine core {rank} is not reachable (restarting).")
        return super()._unreachable(rank)

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

    # -- requests -----------------------------------------------------------------------

    async def get_output_async(self) -> EngineCoreOutputs | EngineFailure:
        self._ensure_output_task()
        assert self.outputs_queue is not None
        out = await self.outputs_queue.get()
        if isinstance(out, Exception):
            self.outputs_queue.put_nowait(out)
            raise out
        return out

    def _serving_ranks(self) -> list[int]:
        ranks = [r for r in self.ranks if r not in self.restarting]
        if not ranks:
            raise EngineRestartingError(
                "The engine core is restarting after a failure; retry the request shortly."
            )
        return ranks

    def _choose_rank(self, request: EngineCoreRequest) -> int:
        return self._serving_ranks()[0]

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_output_task()
        self.ensure_alive()
        rank = self._choose_rank(request)
        self.reqs_in_flight[request.request_id] = rank
        self.in_flight_counts[rank] += 1
        try:
            self._send(rank, EngineCoreRequestType.ADD, request)
        except BaseException:
            if self.reqs_in_flight.pop(request.request_id, None) is not None:
                self.in_flight_counts[rank] -= 1
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            for rank, ids in self._group_aborts(request_ids).items():
                if rank not in self.restarting:
                    self._send(rank, EngineCoreRequestType.ABORT, ids)

    def _group_aborts(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for req_id in request_ids:
            rank = self.reqs_in_flight.get(req_id)
            if rank is not None:
                groups.setdefault(rank, []).append(req_id)
        return groups

    async def call_utility_async(self, method: str, *args: Any, rank: int | None = None) -> Any:
        self._ensure_output_task()
        assert self._loop is not None
        rank = self._serving_ranks()[0] if rank is None else rank
        if rank in self.restarting:
            raise EngineRestartingError(f"Engine core {rank} is restarting after a failure.")
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self.utility_results[call_id] = fut
        self.utility_ranks[call_id] = rank
        fut.add_done_callback(lambda _: self.utility_ranks.pop(call_id, None))
        self._send(rank, EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        return await fut

    def shutdown(self) -> None:
        for task in [self._output_task, self._watch_task, self._handshake_task, *self._restart_tasks]:
            if task is not None and not task.done():
                try:
                    task.cancel()
                except RuntimeError:
                    pass  # loop already closed
        super().shutdown()


class DPAsyncMPClient(AsyncMPClient):
    """One data-parallel rank (given by data_parallel_rank); an external router balances."""

    def __init__(self, config: EngineConfig):
        rank = config.parallel_config.data_parallel_rank or 0
        super().__init__(config, ranks=(rank,))


class DPLBAsyncMPClient(AsyncMPClient):
    """N engine processes; each request goes to the least-loaded serving engine."""

    def __init__(self, config: EngineConfig):
        n = config.parallel_config.data_parallel_size
        self.waiting_counts: dict[int, int] = dict.fromkeys(range(n), 0)
        self.requests_sent: dict[int, int] = dict.fromkeys(range(n), 0)
        self._rr = 0
        super().__init__(config, ranks=range(n))

    async def call_utility_async(self, method: str, *args: Any, rank: int | None = None) -> Any:
        """Without a rank, every serving engine runs it (reset_prefix_cache must empty
        every engine's cache); the first engine's result is returned."""
        if rank is not None:
            return await super().call_utility_async(method, *args, rank=rank)
        results = await asyncio.gather(*(super(DPLBAsyncMPClient, self).call_utility_async(method, *args, rank=r)
                                         for r in self._serving_ranks()))
        return results[0]

    def _choose_rank(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            rank = request.data_parallel_rank
            if rank not in self.in_flight_counts:
                raise ValueError(f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)}).")
            if rank in self.restarting:
                raise EngineRestartingError(f"Engine core {rank} is restarting after a failure; retry shortly.")
        else:
            # Least loaded by in-flight + waiting; start from a rotating offset for ties.
            serving = self._serving_ranks()
            n = len(serving)
            order = [serving[(self._rr + i) % n] for i in range(n)]
            self._rr = (self._rr + 1) % len(self.ranks)
            rank = min(order, key=lambda r: self.in_flight_counts[r] + self.waiting_counts[r])
        self.requests_sent[rank] += 1
        return rank

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.waiting_counts[outputs.engine_index] = outputs.scheduler_stats.num_waiting_reqs
        super()._on_outputs(outputs)

    def _forget_rank(self, rank: int) -> None:
        self.waiting_counts[rank] = 0
