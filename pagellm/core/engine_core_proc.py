"""EngineCoreProc: the engine core's process shell (handshake, IO threads, busy loop).

Started by the client as `python -m pagellm.core.engine_core_proc` (never by forking or
re-importing the user's script). Holds no policy: it moves messages between ZMQ sockets
and an EngineCore. Exits on SIGTERM, on a fatal error (after sending a dead frame with the cause)
and when its parent process dies.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from pagellm.core import ENGINE_STOP_SIGNAL, serial
from pagellm.core.engine_core import EngineCore
from pagellm.core.protocol import (
    ENGINE_CORE_DEAD,
    ENGINE_REFUSED_EXIT_CODE,
    HANDSHAKE_FAILED,
    HEARTBEAT_INTERVAL_S,
    EngineCoreOutputs,
    EngineCoreRequestType,
    UtilityOutput,
    engine_dead_frame,
    engine_identity,
    heartbeat_frame,
)
from pagellm.logger import init_logger
from pagellm.utils import PROGRESS

logger = init_logger(__name__)

_POLL_MS = 100


class EngineCoreProc:
    def __init__(self, engine: EngineCore, input_address: str, output_address: str, rank: int):
        self.engine = engine
        self.rank = rank
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType | None, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.shutdown_requested = False
        self.exit_status = 0  # set by the frontend's STOP: 1 declared dead, or refused
        self._threads = [
            threading.Thread(target=self._input_loop, args=(input_address,), daemon=True),
            threading.Thread(target=self._output_loop, args=(output_address,), daemon=True),
            threading.Thread(target=self._heartbeat_loop, daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- IO threads ------------------------------------------------------------------

    def _input_loop(self, address: str) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, engine_identity(self.rank, _incarnation()))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # the head may be at an IPv6 address
        sock.connect(address)
        sock.send(serial.encode(self.engine.ready_response()))
        while True:
            if not sock.poll(_POLL_MS):
                continue
            kind, payload = sock.recv_multipart(copy=False)
            try:
                req_type = EngineCoreRequestType(bytes(kind.buffer))
                if req_type == EngineCoreRequestType.STOP:
                    self._stop(*serial.stop_decoder.decode(payload.buffer))
                    return
                self._receive(req_type, payload.buffer)
            except Exception as e:
                # A message this core cannot read: its sender would wait forever for an
                # answer, so the core dies and every client gets EngineDeadError.
                logger.error("Engine core %d could not read a message:\n%s", self.rank, traceback.format_exc())
                self.input_queue.put((None, e))
                return

    def _receive(self, req_type: EngineCoreRequestType, payload: Any) -> None:
        if req_type == EngineCoreRequestType.ADD:
            request = serial.request_decoder.decode(payload)
            self.input_queue.put((req_type, self.engine.preprocess_add_request(request)))
        elif req_type == EngineCoreRequestType.ABORT:
            request_ids = serial.abort_decoder.decode(payload)
            # the engine core applies it at once (between forward and update) and again
            # in order with the adds queued before it
            self.input_queue.put((req_type, (self.engine.receive_abort(request_ids), request_ids)))
        else:
            self.input_queue.put((req_type, serial.utility_decoder.decode(payload)))

    def _stop(self, reason: str, refused: bool) -> None:
        """The frontend dropped this core: it stops without a dead frame (the frontend
        knows), with a status that tells its node whether to start it again."""
        logger.error("Engine core %d: the frontend %s: %s", self.rank,
                     "refused its handshake" if refused else "declared it dead", reason)
        self.exit_status = ENGINE_REFUSED_EXIT_CODE if refused else 1
        self.shutdown_requested = True
        # a core declared dead may be stuck (hung in a step): it exits in any case, so that
        # its node sees the exit and starts a new one
        timer = threading.Timer(5.0, os._exit, (self.exit_status,))
        timer.daemon = True
        timer.start()

    def _output_loop(self, address: str) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 4000)  # so the dead sentinel still gets out
        sock.setsockopt(zmq.IPV6, 1)  # the head may be at an IPv6 address
        sock.connect(address)
        while True:
            item = self.output_queue.get()
            if not isinstance(item, bytes):
                sock.send(serial.encode(item), copy=False)
                continue
            sock.send(item)  # a heartbeat or the dead frame, the last thing this core sends
            if item.startswith(ENGINE_CORE_DEAD):
                time.sleep(0.1)
                return

    def _heartbeat_loop(self) -> None:
        """Tells the frontend, every HEARTBEAT_INTERVAL_S, how far this core has got and
        whether it has work: a stopped or frozen process sends nothing, a stuck busy loop
        sends a count that stands still."""
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            busy = (self.engine.has_work() or not self.input_queue.empty()) and not PROGRESS.paused
            self.output_queue.put(heartbeat_frame(self.rank, PROGRESS.count, busy))

    # -- busy loop -------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        while not self.shutdown_requested:
            self._process_input_queue()
            if self.shutdown_requested:
                break
            outputs, _ = self.engine.step()
            PROGRESS.tick()
            for out in outputs.values():
                out.engine_index = self.rank  # the DP client balances on per-engine counts
                self.output_queue.put(out)

    def _process_input_queue(self) -> None:
        # Block only when idle; otherwise drain what has arrived and go on stepping.
        while not self.engine.has_work() and not self.shutdown_requested:
            try:
                self._handle(*self.input_queue.get(timeout=_POLL_MS / 1000))
                break
            except queue.Empty:
                continue
        while True:
            try:
                self._handle(*self.input_queue.get_nowait())
            except queue.Empty:
                return

    def _handle(self, req_type: EngineCoreRequestType | None, payload: Any) -> None:
        if req_type is None:  # the input thread failed
            raise RuntimeError("the engine core's input thread failed") from payload
        if req_type == EngineCoreRequestType.ADD:
            self.engine.add_request(payload)
        elif req_type == EngineCoreRequestType.ABORT:
            self.engine.abort_in_order(*payload)
        else:
            call_id, method, args = payload
            try:
                result = getattr(self.engine, method)(*args)
                out = UtilityOutput(call_id, None, result)
            except Exception as e:  # reported to the caller, not fatal
                out = UtilityOutput(call_id, f"{type(e).__name__}: {e}", None)
            self.output_queue.put(EngineCoreOutputs(engine_index=self.rank, utility_output=out))

    def send_dead(self, cause: str) -> None:
        self.output_queue.put(engine_dead_frame(self.rank, cause))
        self._threads[1].join(timeout=5)


def _incarnation() -> bytes:
    """This process in its ZMQ identity, after the rank: its pid (the head tells its own
    cores from others' by it) and random bytes (pids repeat across machines)."""
    return os.getpid().to_bytes(4, "little") + os.urandom(2)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _set_parent_death_signal() -> None:
    """Linux: get SIGKILL when the parent dies, even if the watcher thread is stuck."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _send_startup_failure(input_address: str, rank: int, message: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, engine_identity(rank, _incarnation()))
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.IPV6, 1)
    sock.connect(input_address)
    sock.send_multipart([HANDSHAKE_FAILED, message.encode()])
    sock.close()


def serve_engine_core(config: Any, rank: int, input_address: str, output_address: str,
                      on_start: Callable[[EngineCoreProc], None] | None = None) -> int:
    """Builds rank's EngineCore, handshakes with the frontend and runs the busy loop until a
    stop; returns the exit status (1 after a startup failure or a fatal error, each sent to
    the frontend first). The engine-core process's main runs it, and so does a Ray actor
    (pagellm/distributed/ray_engines.py): one loop for both. `on_start` gets the
    EngineCoreProc once it runs (its owner may then ask it to stop)."""
    try:
        engine = EngineCore(config.with_data_parallel_rank(rank))
    except Exception as e:
        logger.error("Engine core %d failed to start:\n%s", rank, traceback.format_exc())
        _send_startup_failure(input_address, rank, f"{type(e).__name__}: {e}")
        return 1
    proc = EngineCoreProc(engine, input_address, output_address, rank)
    if on_start is not None:
        on_start(proc)
    try:
        proc.run_busy_loop()
    except Exception as e:
        logger.error("Engine core %d died:\n%s", rank, traceback.format_exc())
        proc.send_dead(f"{type(e).__name__}: {e}")
        return 1
    finally:
        engine.shutdown()
    return proc.exit_status


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()

    _set_parent_death_signal()
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    running: list[EngineCoreProc] = []

    def on_stop(signum: int, frame: Any) -> None:
        if not running:
            _exit_now(0)
        running[0].shutdown_requested = True

    # The frontend owns Ctrl-C and SIGTERM (it drains, then stops its cores); a core stops
    # when told (ENGINE_STOP_SIGNAL) or when its parent dies.
    signal.signal(ENGINE_STOP_SIGNAL, on_stop)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    payload = sys.stdin.buffer.read()  # process bootstrap only, never the wire
    if not payload:  # a prestarted process its frontend never claimed
        _exit_now(0)
    config = pickle.loads(payload)
    status = serve_engine_core(config, args.rank, args.input_address, args.output_address, running.append)
    if status and not running:  # a startup failure: exit as before, through the interpreter
        sys.exit(status)
    _exit_now(status)


def _exit_now(code: int) -> None:
    """Ends the process once its own shutdown is done, skipping the interpreter's teardown
    of torch's modules: ~0.8 s here, which the frontend waiting on this exit would pay."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
