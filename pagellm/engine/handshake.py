"""Engine cores joining a frontend: where they connect, and which handshakes it accepts.

In: a core's first frame on the ROUTER (its READY response, or FAILED with the cause).
Out: the accepted (identity, response) per rank, or the reason a core is refused, which
the core is sent (a STOP) and the log shows. One machine uses IPC sockets in a temporary
directory; with data_parallel_address the head binds TCP sockets there and cores on
--headless nodes connect to them. Knows no policy of what happens to requests.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from pagellm.config import ParallelConfig
from pagellm.core import serial
from pagellm.core.protocol import (
    HANDSHAKE_FAILED,
    EngineCoreReadyResponse,
    EngineCoreRequestType,
    rank_of_identity,
)
from pagellm.engine.exceptions import EngineStartupError
from pagellm.engine.prestart import socket_addresses
from pagellm.logger import init_logger

logger = init_logger(__name__)


def engine_addresses(pc: ParallelConfig, tmpdir: str | None) -> tuple[str, str]:
    """(input, output) addresses of the engine sockets: the head's TCP ports when
    data_parallel_address is set (input on the RPC port, output on the next), else IPC
    files in `tmpdir`."""
    if pc.data_parallel_address is None:
        assert tmpdir is not None
        return socket_addresses(tmpdir)
    host = pc.data_parallel_address
    host = f"[{host}]" if ":" in host else host  # an IPv6 literal
    return f"tcp://{host}:{pc.data_parallel_rpc_port}", f"tcp://{host}:{pc.data_parallel_rpc_port + 1}"


def pid_of_identity(identity: bytes) -> int:
    """The process id an engine core put in its identity (after the rank's two bytes)."""
    return int.from_bytes(identity[2:6], "little")


def fingerprint_diff(head: Mapping[str, str], core: Mapping[str, str], rank: int) -> list[str]:
    """'field (head: X, rank r: Y)' for each field where a core's config differs."""
    return [f"{name} (head: {head.get(name)}, rank {rank}: {core.get(name)})"
            for name in sorted(set(head) | set(core)) if head.get(name) != core.get(name)]


@dataclass
class HandshakeCheck:
    """What a READY must show to be served: a rank in range that no other process serves
    (a rank the head runs itself only from the head's own process), and a config that
    agrees with the head's (EngineConfig.fingerprint)."""

    num_ranks: int
    fingerprint: dict[str, str]
    local_pids: dict[int, int] = field(default_factory=dict)
    """rank -> pid of the head's own process for it (kept current across restarts)."""

    def refusal(self, identity: bytes, response: EngineCoreReadyResponse, taken: bool) -> str | None:
        """Why this core may not serve its rank; None: it may. `taken`: another live
        process serves the rank now."""
        rank = rank_of_identity(identity)
        if response.rank != rank:
            return f"its identity says rank {rank} and its handshake rank {response.rank}."
        if not 0 <= rank < self.num_ranks:
            return (f"rank {rank} is out of range: data_parallel_size is {self.num_ranks} "
                    f"(ranks 0..{self.num_ranks - 1}).")
        if rank in self.local_pids and pid_of_identity(identity) != self.local_pids[rank]:
            return f"rank {rank} runs on the head node (its --data-parallel-size-local covers it)."
        if taken:
            return f"rank {rank} is already served by another engine core (overlapping --data-parallel-start-rank?)."
        differs = fingerprint_diff(self.fingerprint, response.fingerprint, rank)
        if differs:
            return "its config differs from the head's: " + "; ".join(differs) + "."
        return None


def send_stop(sock: zmq.Socket, identity: bytes, reason: str, refused: bool) -> None:
    """Sends a core STOP with the reason: it exits (`refused`: its node does not start it
    again). A core already gone is not an error."""
    try:
        sock.send_multipart([identity, EngineCoreRequestType.STOP.value, serial.encode((reason, refused))])
    except zmq.ZMQError:
        pass


def connected(sock: zmq.Socket, identity: bytes) -> bool:
    """Whether the core with `identity` is still connected to the ROUTER (ROUTER_MANDATORY):
    an empty abort, which the ROUTER refuses to route to a closed connection."""
    try:
        sock.send_multipart([identity, EngineCoreRequestType.ABORT.value, serial.encode([])])
    except zmq.ZMQError:
        return False
    return True


def exited_early(rank: int, returncode: int | None) -> EngineStartupError:
    return EngineStartupError(
        f"Engine core initialization failed: process (rank {rank}) exited with code "
        f"{returncode}. See its log above."
    )


def wait_for_ready(sock: zmq.Socket, check: HandshakeCheck, ranks: Sequence[int], procs: Mapping[int, object],
                   address: str, timeout: float) -> dict[int, tuple[bytes, EngineCoreReadyResponse]]:
    """Waits for the accepted READY of each of `ranks`: (identity, response) by rank. A local
    process (in `procs`, Popen-like) that fails or exits fails the start at once; a
    remote core that fails or is refused is logged and waited for again (its node may
    start a good one) until `timeout`, when the error names the ranks still missing."""
    accepted: dict[int, tuple[bytes, EngineCoreReadyResponse]] = {}
    problems: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while any(rank not in accepted for rank in ranks):
        if time.monotonic() > deadline:
            raise _missing_ranks(ranks, accepted, problems, address, timeout)
        if sock.poll(100):
            _take_handshake(sock, check, procs, accepted, problems)
            continue
        for rank, proc in procs.items():
            if rank not in accepted and proc.poll() is not None:  # type: ignore[attr-defined]
                if sock.poll(200):  # it may have sent FAILED just before exiting
                    break
                raise exited_early(rank, proc.returncode)  # type: ignore[attr-defined]
    return accepted


@dataclass
class Handshake:
    """A core's first message: READY with its response, or FAILED with the cause."""

    identity: bytes
    response: EngineCoreReadyResponse | None
    failure: str = ""
    """Why the core failed to start (response None)."""

    @property
    def rank(self) -> int:
        return rank_of_identity(self.identity)

    def startup_error(self) -> EngineStartupError:
        return EngineStartupError(f"Engine core initialization failed: {self.failure}")


def read_handshake(sock: zmq.Socket) -> Handshake | None:
    """The next message on the ROUTER as a Handshake; anything else (a stray peer on an
    open TCP port) is logged and None."""
    frames = sock.recv_multipart()
    if len(frames) == 3 and frames[1] == HANDSHAKE_FAILED and len(frames[0]) >= 2:
        return Handshake(frames[0], None, frames[2].decode(errors="replace"))
    if len(frames) == 2 and len(frames[0]) >= 2:
        try:
            return Handshake(frames[0], serial.ready_decoder.decode(frames[1]))
        except msgspec.DecodeError:
            pass
    logger.warning("Ignored a message on the engine socket that is no engine core's handshake (%d frame(s)).",
                   len(frames))
    return None


def _take_handshake(sock: zmq.Socket, check: HandshakeCheck, procs: Mapping[int, object],
                    accepted: dict, problems: dict[int, str]) -> None:
    hs = read_handshake(sock)
    if hs is None:
        return
    rank = hs.rank
    if hs.response is None:
        if rank in procs and pid_of_identity(hs.identity) == check.local_pids.get(rank):
            raise hs.startup_error()
        problems[rank] = f"failed to start: {hs.failure}"
        logger.error("Engine core %d (another node) %s", rank, problems[rank])
        return
    # a rank accepted earlier whose core has gone since (its node started another) is free
    taken = rank in accepted and connected(sock, accepted[rank][0])
    reason = check.refusal(hs.identity, hs.response, taken=taken)
    if reason is None:
        accepted[rank] = (hs.identity, hs.response)
        return
    send_stop(sock, hs.identity, reason, refused=True)
    if rank in procs and rank not in accepted:
        raise EngineStartupError(f"Engine core {rank} was refused: {reason}")
    problems[rank] = f"refused: {reason}"
    logger.error("Refused an engine core for rank %d: %s", rank, reason)


def _missing_ranks(ranks: Sequence[int], accepted: Mapping, problems: Mapping[int, str], address: str,
                   timeout: float) -> EngineStartupError:
    missing = [r for r in ranks if r not in accepted]
    lines = [f"Engine core(s) {missing} never connected to {address} within {timeout:g} s "
             f"(PAGELLM_ENGINE_READY_TIMEOUT_S)."]
    lines += [f"rank {r}: {problems[r]}" for r in missing if r in problems]
    return EngineStartupError(" ".join(lines))
