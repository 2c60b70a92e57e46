"""An engine-core process started before the frontend knows its config.

An engine core spends most of its start importing torch (~2 s on a small CPU machine),
and the frontend spends ~0.5 s reading the model's config before it can launch one.
`pagellm generate`, `chat` and `serve` therefore start rank 0's process as soon as their
flags parse: it imports while the frontend works, then blocks reading its config from
stdin. The MP client that comes next claims it and writes the config, as it does for a
process it launches itself. A process nobody claims (the config failed, the frontend
chose to run in-process) reads end-of-file and exits; it is stopped at exit at the latest.

Kept free of heavy imports: it runs before anything else loads.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm import envs
from pagellm.core import ENGINE_STOP_SIGNAL


@dataclass
class PrestartedEngine:
    proc: subprocess.Popen
    tmpdir: str
    """Holds the IPC sockets' files; whoever claims the process owns it."""
    input_addr: str
    output_addr: str


_waiting: PrestartedEngine | None = None



def launch_engine_process(rank: int, input_addr: str, output_addr: str) -> subprocess.Popen:
    """An engine-core process for `rank` (its config still to be written to its stdin), in
    a session of its own, so that a signal to the frontend's process group misses it."""
    return subprocess.Popen(engine_command(rank, input_addr, output_addr), stdin=subprocess.PIPE,
                            env=envs.compute_env(), start_new_session=True)


def stop_engine_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Asks an engine-core process to stop (ENGINE_STOP_SIGNAL) and waits; SIGKILL after
    `timeout` seconds."""
    stop_engine_processes([proc], timeout)


def stop_engine_processes(procs: Iterable[subprocess.Popen], timeout: float = 5.0) -> None:
    """ENGINE_STOP_SIGNAL to every live one of `procs`, then up to `timeout` seconds for
    them all together; SIGKILL to any still running."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        proc.send_signal(ENGINE_STOP_SIGNAL)
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def engine_command(rank: int, input_addr: str, output_addr: str) -> list[str]:
    """The command line of an engine-core process for `rank`, reporting to this process.
    Start it with `env=envs.compute_env()`: this process's environment plus pagellm's
    OpenMP wait policy (unless the user chose one), which os.environ never gets."""
    return [
        sys.executable, "-m", "pagellm.core.engine_core_proc",
        "--input-address", input_addr, "--output-address", output_addr,
        "--rank", str(rank), "--parent-pid", str(os.getpid()),
    ]


def socket_addresses(tmpdir: str) -> tuple[str, str]:
    """(input, output) IPC addresses of the engine sockets in `tmpdir`."""
    return f"ipc://{tmpdir}/input.sock", f"ipc://{tmpdir}/output.sock"


def prestart_engine_core() -> None:
    """Starts rank 0's engine-core process now, for the next MP client to claim."""
    global _waiting
    if _waiting is not None:
        return
    tmpdir = tempfile.mkdtemp(prefix="pagellm-")
    input_addr, output_addr = socket_addresses(tmpdir)
    proc = launch_engine_process(0, input_addr, output_addr)
    _waiting = PrestartedEngine(proc, tmpdir, input_addr, output_addr)
    atexit.register(discard_prestarted)


def claim_prestarted() -> PrestartedEngine | None:
    """The waiting process (the caller now owns it and its tmpdir), or None when there is
    none or it already exited."""
    global _waiting
    engine, _waiting = _waiting, None
    if engine is not None and engine.proc.poll() is not None:
        _stop(engine)
        return None
    return engine


def discard_prestarted() -> None:
    engine = claim_prestarted()
    if engine is not None:
        _stop(engine)


def _stop(engine: PrestartedEngine) -> None:
    proc = engine.proc
    if proc.stdin is not None:
        proc.stdin.close()  # end of file: it exits without loading anything
    stop_engine_process(proc)
    shutil.rmtree(engine.tmpdir, ignore_errors=True)
