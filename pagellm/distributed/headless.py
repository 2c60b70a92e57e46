"""A --headless node: engine cores for ranks of another node's server, and no frontend.

In: this node's own flags (its EngineConfig, built here: no config crosses the network).
Out: engine-core processes for ranks data_parallel_start_rank.. that connect to the head's
TCP sockets (data_parallel_address, data_parallel_rpc_port) and handshake with it there.
The node supervises them: a core that dies is started again (restart_engine_on_failure;
without it the node exits 1 for its own supervisor), a core the head refused ends the node,
and SIGTERM / SIGINT stop every core and exit 0. It knows nothing of requests.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.protocol import ENGINE_REFUSED_EXIT_CODE
from pagellm.engine.core_client import launch_engines
from pagellm.engine.handshake import engine_addresses
from pagellm.engine.prestart import stop_engine_processes
from pagellm.logger import init_logger
from pagellm.utils import describe_exit

logger = init_logger(__name__)


class HeadlessNode:
    MAX_RESTART_ATTEMPTS = 3
    """Deaths of a rank in a row (each within STABLE_S of its start) before the node gives up."""
    STABLE_S = 60.0
    """A core that has run this long has started well: its count of deaths starts again."""

    def __init__(self, config: EngineConfig):
        pc = config.parallel_config
        self.config = config
        self.ranks = list(pc.local_ranks)
        self.input_addr, self.output_addr = engine_addresses(pc, None)
        self.restart_on_failure = pc.restart_engine_on_failure
        self.procs: dict[int, subprocess.Popen] = {}
        self.started_at: dict[int, float] = {}
        self.deaths = dict.fromkeys(self.ranks, 0)
        self.due: dict[int, float] = {}  # rank -> when its next start is due
        self.stop_requested = threading.Event()

    def run(self) -> int:
        """Starts the cores and supervises them until a signal (0) or a failure (1)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for rank in self.ranks:
                self._start(rank)
            logger.info("Headless node: engine core(s) %s connect to the head at %s.", self.ranks, self.input_addr)
            while not self.stop_requested.wait(0.1):
                status = self._supervise()
                if status is not None:
                    return status
            logger.info("Headless node stopping its engine core(s).")
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_requested.set()

    def _start(self, rank: int) -> None:
        (self.procs[rank],) = launch_engines(self.config, [rank], self.input_addr, self.output_addr)
        self.started_at[rank] = time.monotonic()

    def _supervise(self) -> int | None:
        """One look at every core: starts what is due, handles what died; a status ends the node."""
        now = time.monotonic()
        for rank in self.ranks:
            if rank in self.due:
                if now >= self.due[rank]:
                    del self.due[rank]
                    self._start(rank)
                continue
            proc = self.procs[rank]
            if proc.poll() is None:
                if now - self.started_at[rank] > self.STABLE_S:
                    self.deaths[rank] = 0
                continue
            status = self._on_death(rank, proc, now)
            if status is not None:
                return status
        return None

    def _on_death(self, rank: int, proc: subprocess.Popen, now: float) -> int | None:
        if proc.returncode == ENGINE_REFUSED_EXIT_CODE:
            logger.error("The head refused engine core %d (the reason is in its log above); this node stops.", rank)
            return 1
        logger.error("Engine core %d (pid %d) died: %s.", rank, proc.pid, describe_exit(proc.returncode))
        if not self.restart_on_failure:
            logger.error("Exiting with status 1 (--restart-engine-on-failure starts a new core in place).")
            return 1
        self.deaths[rank] += 1
        if self.deaths[rank] > self.MAX_RESTART_ATTEMPTS:
            logger.error("Engine core %d died %d times in a row; this node stops.", rank, self.deaths[rank])
            return 1
        delay = 0.0 if self.deaths[rank] == 1 else min(2.0 ** (self.deaths[rank] - 1), 10.0)
        logger.info("Starting a new engine core for rank %d%s.", rank, f" in {delay:g} s" if delay else "")
        self.due[rank] = now + delay
        return None

    def _stop_all(self) -> None:
        stop_engine_processes(self.procs.values())


def run_headless(config: EngineConfig) -> int:
    return HeadlessNode(config).run()
