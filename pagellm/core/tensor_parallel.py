"""Tensor parallelism on one machine: one model split across processes.

The engine core is rank 0. `TensorParallelRunner` stands where its ModelRunner would: it
starts ranks 1..N-1 as processes of this machine (`python -m
pagellm.core.tensor_parallel`, each handed the EngineConfig on its stdin as engine
cores are), joins them in a gloo group over a file store in a temporary directory and
in a shared-memory segment (parallel_state.ShmChannel; both are unlinked once the group
stands), and then makes every ModelRunner call on all ranks: rank 0 broadcasts the call (a scheduler
output each step), each rank runs it on its shard (parallel_state: heads, MLP columns,
vocabulary), and the layers' sums and the logits' gather happen inside the forward. The
scheduler, the KV-cache manager and the client see one runner.

Every rank samples from the same gathered logits with the same seeded generators (the
global one seeded alike on every rank), so every rank appends the same tokens to its
input batch; each step's broadcast carries rank 0's previous tokens, and a rank whose own
differ stops with an error rather than decode from another sequence. A rank that dies
ends rank 0's next collective with an error naming it (the engine core then dies, as it
does on any model error, and the client sees EngineDeadError); ranks 1..N-1 end with the
engine core (parent-death signal, and a broken collective).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.kernels import load_kernels
from pagellm.logger import init_logger
from pagellm.model_executor.parallel_state import (
    ShmChannel,
    TensorParallelGroup,
    init_tensor_parallel_group,
)
from pagellm.outputs import ModelRunnerOutput
from pagellm.scheduler_output import SchedulerOutput
from pagellm.utils import describe_exit
from pagellm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

JOIN_TIMEOUT_S = 300.0
"""Seconds rank 0 waits for the other ranks to join the group (they import torch first)."""


def rank_cores(rank: int, size: int, engines: int) -> list[int] | None:
    """The CPU cores rank `rank` is bound to: its share of this process's cores where each
    of the machine's `engines` engine cores' ranks can have its own, else None (unbound)."""
    cores = sorted(os.sched_getaffinity(0))
    if engines != 1 or len(cores) < size:
        return None
    share = len(cores) // size
    return cores[rank * share : (rank + 1) * share]


class TensorParallelRunner:
    """Rank 0's ModelRunner, driving ranks 1..N-1 through the same calls."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel_config.tensor_parallel_size
        self._closed = False
        self._last_sampled: list[list[int]] | None = None
        """Rank 0's tokens of the step before, which the next call carries to the others."""
        self._tmpdir = tempfile.mkdtemp(prefix="pagellm-tp-")
        store = os.path.join(self._tmpdir, "store")
        self._shm_path = shm_segment_path(size) if load_kernels() is not None else ""
        if self._shm_path:
            ShmChannel.create(self._shm_path, size)
        # every rank's sampler draws from the same global generator (unseeded requests)
        seed = config.model_config.seed if config.model_config.seed is not None else secrets.randbits(62)
        torch.manual_seed(seed)
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagellm.core.tensor_parallel", "--rank", str(rank),
                 "--size", str(size), "--store", store, "--shm", self._shm_path,
                 "--parent-pid", str(os.getpid())],
                stdin=subprocess.PIPE, env=envs.compute_env(), start_new_session=True)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps((config, seed)))  # process bootstrap, never the wire
            proc.stdin.close()
            self.procs[rank] = proc
        self.group = self._join(size, store)
        # every rank has the segment mapped and gloo's connections made: nothing is left
        # behind on a crash
        self._unlink_segment()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        self.runner = ModelRunner(config, self.group)
        logger.info("Tensor parallel: %d ranks (rank 0 here, ranks 1..%d pids %s)", size, size - 1,
                    ", ".join(str(p.pid) for p in self.procs.values()))

    def _join(self, size: int, store: str) -> TensorParallelGroup:
        """Joins the group, failing fast with the cause if a rank exits before it joins."""
        result: list[Any] = []
        joiner = threading.Thread(target=lambda: result.append(_try(
            init_tensor_parallel_group, 0, size, store, JOIN_TIMEOUT_S, self._shm_path or None,
            self._check_ranks)), daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            dead = self._dead_rank()
            if dead is not None and joiner.is_alive():
                self.shutdown()
                raise RuntimeError(f"tensor parallel rank {dead} {self._exit_cause(dead)} before "
                                   "joining the group")
        outcome = result[0]
        if isinstance(outcome, BaseException):
            self.shutdown()
            raise RuntimeError(f"tensor parallel group of {size} ranks did not form: {outcome}") from outcome
        return outcome

    def _check_ranks(self) -> None:
        """Raises if another rank's process has ended (called while a collective waits)."""
        dead = self._dead_rank()
        if dead is not None:
            raise RuntimeError(f"tensor parallel rank {dead} {self._exit_cause(dead)}")

    def _unlink_segment(self) -> None:
        if self._shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._shm_path)

    def _dead_rank(self) -> int | None:
        return next((rank for rank, p in self.procs.items() if p.poll() is not None), None)

    def _exit_cause(self, rank: int) -> str:
        return describe_exit(self.procs[rank].returncode)

    def _call(self, name: str, *args: Any, check: Any = None) -> Any:
        """`name(*args)` on every rank's runner; rank 0's result."""
        try:
            self.group.broadcast_object((name, args, check))
            return getattr(self.runner, name)(*args)
        except RuntimeError as e:  # a collective broken by a rank that died
            time.sleep(0.2)  # its exit status, where it is exiting
            dead = self._dead_rank()
            if dead is None or str(e).startswith(f"tensor parallel rank {dead} "):
                raise
            raise RuntimeError(f"tensor parallel rank {dead} {self._exit_cause(dead)}: {e}") from e

    # -- what the engine core calls on its model runner ------------------------------------

    def load_model(self) -> None:
        self._call("load_model")

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def determine_num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        return self.runner.determine_num_blocks(extra_bytes_per_block)  # rank 0 decides for all

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = self._call("execute_model", sched, check=self._last_sampled)
        self._last_sampled = [list(t) for t in out.sampled_token_ids]  # as sampled: the scheduler may trim
        return out

    def shutdown(self) -> None:
        """Stops the other ranks (asked, then killed after 5 s) and removes the store."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "group") and self._dead_rank() is None:
            try:
                self.group.broadcast_object(("shutdown", (), None))
            except RuntimeError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._unlink_segment()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # handed to the waiting thread
        return e


def shm_segment_path(size: int) -> str:
    """A new name for the ranks' shared segment: in /dev/shm where it has room for it (a
    container's is often 64 MB, and a write past a full tmpfs is a SIGBUS), else in the
    temporary directory (a file both map: the page cache shares it just the same)."""
    need = ShmChannel.segment_bytes(size)
    where = tempfile.gettempdir()
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= 2 * need:
            where = "/dev/shm"
    return os.path.join(where, f"pagellm-tp-{os.getpid()}-{secrets.token_hex(4)}")


def serve_rank(config: EngineConfig, seed: int, rank: int, size: int, store: str, shm: str) -> None:
    """Ranks 1..N-1: joins the group, then runs each call rank 0 broadcasts until told to
    stop."""
    from pagellm.core.engine_core import _confirm_quantization, _set_num_threads

    cores = rank_cores(rank, size, config.parallel_config.num_engines_on_this_machine)
    if cores:
        os.sched_setaffinity(0, cores)
    _set_num_threads(config)
    torch.manual_seed(seed)
    group = init_tensor_parallel_group(rank, size, store, JOIN_TIMEOUT_S, shm or None)
    runner = ModelRunner(_confirm_quantization(config), group)
    mine = None
    while True:
        name, args, check = group.broadcast_object()
        if name == "shutdown":
            return
        if check is not None and check != mine:
            raise RuntimeError(f"tensor parallel rank {rank} sampled {mine}, rank 0 {check}: the ranks' "
                               "sequences differ")
        result = getattr(runner, name)(*args)
        if name == "execute_model":
            mine = result.sampled_token_ids


def main() -> None:
    from pagellm.core.engine_core_proc import _set_parent_death_signal, _watch_parent

    parser = argparse.ArgumentParser(description="A tensor-parallel rank of a pagellm engine core.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--shm", default="", help="the ranks' shared segment ('': gloo only)")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    _set_parent_death_signal()
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    config, seed = pickle.loads(sys.stdin.buffer.read())
    try:
        serve_rank(config, seed, args.rank, args.size, args.store, args.shm)
    except Exception:
        logger.exception("tensor parallel rank %d failed", args.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
