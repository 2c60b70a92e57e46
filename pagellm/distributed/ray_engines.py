"""Engine cores as Ray actors (--data-parallel-backend ray), vLLM's CoreEngineActorManager.

In: the head's EngineConfig and the frontend's TCP engine sockets. Out: one Ray actor per
data-parallel rank, placed by one placement group (a bundle of CPUs per rank) on the
cluster RAY_ADDRESS or `ray start` names, else on a local one started here. Each actor runs
the engine-core loop an engine-core process runs (serve_engine_core) and handshakes with
the frontend over ZMQ like a --headless node's core; only its config comes through Ray's
own argument passing. The client sees an actor as a process (RayEngineProcess): its end
(killed, its node gone) is an exit, which drives the restart as a dead process's does.
Knows nothing of requests.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.engine.exceptions import EngineStartupError
from pagellm.logger import init_logger

logger = init_logger(__name__)

# What a Ray worker takes from the frontend's environment (a worker of another node starts
# from its raylet's): pagellm's settings, the Hugging Face cache and OpenMP's.
_ENV_PREFIXES = ("PAGELLM_", "HF_", "TRANSFORMERS_", "OMP_", "GOMP_", "KMP_")
_PLACEMENT_LOG_S = 10.0


class EngineCoreActor:
    """The body of one rank's Ray actor (made a remote class with ray.remote at launch,
    with two threads: `run` holds one, `where` and `stop` answer on the other)."""

    def __init__(self) -> None:
        self._proc: Any = None  # the EngineCoreProc, once it runs
        self._stop = threading.Event()

    def where(self) -> tuple[str, int]:
        """(node id, pid) of this actor's process."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, config: EngineConfig, rank: int, input_address: str, output_address: str) -> int:
        """The engine core, until it is told to stop: its exit status (as a process's)."""
        from pagellm.core.engine_core_proc import serve_engine_core

        def started(proc: Any) -> None:
            self._proc = proc
            if self._stop.is_set():
                proc.shutdown_requested = True

        status = serve_engine_core(config, rank, input_address, output_address, started)
        if status and self._proc is None:
            time.sleep(0.5)  # the FAILED handshake still leaving this process's socket
        return status

    def stop(self) -> None:
        """Asks the engine core to stop after its current step (the process's ENGINE_STOP_SIGNAL)."""
        self._stop.set()
        if self._proc is not None:
            self._proc.shutdown_requested = True


class RayEngineProcess:
    """One rank's actor, seen as the subprocess.Popen the client watches: poll(), wait(),
    kill(), send_signal() (a stop), pid and returncode. An actor that dies (ray.kill, its
    process killed, its node lost) has ended with returncode 1 and `exit_cause` in words."""

    def __init__(self, actor: Any, run_ref: Any, rank: int, node_id: str, node_ip: str, pid: int):
        self.actor = actor
        self.run_ref = run_ref
        self.rank = rank
        self.node_id = node_id
        self.node_ip = node_ip
        self.pid = pid
        self.returncode: int | None = None
        self.exit_cause: str | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        import ray

        # Every call checks that this process is still a driver: a Ray call after
        # ray.shutdown() would start a new local cluster (Ray's auto-init).
        if not ray.is_initialized():
            self._end(1, "this process left the Ray cluster (its actors end with it)")
            return self.returncode
        try:
            ready, _ = ray.wait([self.run_ref], timeout=0)
        except Exception:  # ray.shutdown() in another thread meanwhile
            if ray.is_initialized():
                raise
            ready = [self.run_ref]
        if ready:
            self._end(*self._outcome())
        return self.returncode

    def _outcome(self) -> tuple[int, str]:
        """(exit status, cause) of the finished run call."""
        import ray

        try:
            code = ray.get(self.run_ref, timeout=5)
            return code, f"exited with code {code}"
        except ray.exceptions.RayActorError as e:
            how = "killed by ray.kill()" if "ray.kill" in str(e) else "its process or node died"
            return 1, f"its Ray actor died ({how})"
        except Exception as e:  # another Ray error, or this process left the cluster meanwhile
            return 1, f"its Ray actor failed: {type(e).__name__}"

    def _end(self, code: int, cause: str) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self.kill()  # frees its bundle's CPUs for the next core
            self.exit_cause, self.returncode = cause, code

    def wait(self, timeout: float | None = None) -> int:
        import ray

        if self.poll() is None:
            ray.wait([self.run_ref], timeout=timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"engine core actor {self.rank}", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Any signal asks the core to stop (the client sends only ENGINE_STOP_SIGNAL)."""
        if self.poll() is None:
            self.actor.stop.remote()

    def kill(self) -> None:
        import ray

        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)


class CoreEngineActorManager:
    """The Ray side of one client: joins (or starts) the cluster, reserves one bundle of
    CPUs per rank in one placement group, and starts an actor for a rank in its bundle
    (at start and at every restart). close() removes the group, and the local cluster it
    started."""

    def __init__(self, config: EngineConfig):
        ray = import_ray()
        from ray.util.placement_group import placement_group

        self.config = config
        self.initialized_ray = not ray.is_initialized()
        if self.initialized_ray:
            # RAY_ADDRESS, else a cluster `ray start` runs on this machine, else a local one
            try:
                ray.init(include_dashboard=False, log_to_driver=True, namespace=f"pagellm-{uuid.uuid4().hex[:8]}")
            except Exception as e:
                raise EngineStartupError(f"Cannot join or start a Ray cluster (RAY_ADDRESS="
                                         f"{os.environ.get('RAY_ADDRESS')!r}): {type(e).__name__}: {e}") from e
        n = config.parallel_config.data_parallel_size
        self.cpus = envs.PAGELLM_NUM_THREADS or max(1, int(ray.cluster_resources().get("CPU", 1)) // n)
        # SPREAD: ranks on different nodes where the cluster has room (each replica its own
        # memory bandwidth), packed where it has not
        self.placement_group = placement_group([{"CPU": self.cpus}] * n, strategy="SPREAD",
                                               name=f"pagellm-dp-{uuid.uuid4().hex[:8]}")
        self._wait_placed(n)
        self.env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        self.env.update(envs.openmp_defaults())
        self.env["PAGELLM_NUM_THREADS"] = str(self.cpus)  # the engine's threads: its bundle's CPUs

    def _wait_placed(self, n: int) -> None:
        import ray

        deadline = time.monotonic() + envs.PAGELLM_ENGINE_READY_TIMEOUT_S
        while True:
            ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_LOG_S)
            if ready:
                return
            need = f"{n} bundle(s) of {self.cpus} CPU(s)"
            have = {node["NodeManagerAddress"]: node["Resources"].get("CPU", 0)
                    for node in ray.nodes() if node["Alive"]}
            if time.monotonic() > deadline:
                self.close()
                raise EngineStartupError(
                    f"Ray could not place the engine cores' placement group ({need}) within "
                    f"{envs.PAGELLM_ENGINE_READY_TIMEOUT_S:g} s (PAGELLM_ENGINE_READY_TIMEOUT_S); the "
                    f"cluster's CPUs by node: {have}. Set PAGELLM_NUM_THREADS to the CPUs per engine core.")
            logger.warning("Waiting for Ray to place %s (the cluster's CPUs by node: %s).", need, have)

    def frontend_host(self) -> str:
        """Where the engine sockets bind when data_parallel_address is not given: this
        node's address as the Ray cluster knows it."""
        import ray

        return ray.util.get_node_ip_address()  # the address its raylet has (`ray start --node-ip-address`)

    def launch(self, ranks: Sequence[int], input_addr: str, output_addr: str) -> list[RayEngineProcess]:
        """An actor per rank in the rank's bundle, each started on the engine-core loop."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_class = ray.remote(EngineCoreActor)
        actors = [
            remote_class.options(
                num_cpus=self.cpus, max_concurrency=2, max_restarts=0, runtime_env={"env_vars": self.env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=rank),
            ).remote()
            for rank in ranks
        ]
        try:
            places = ray.get([actor.where.remote() for actor in actors],
                             timeout=envs.PAGELLM_ENGINE_READY_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise EngineStartupError(f"Ray could not start the engine core actor(s) for ranks {list(ranks)}: "
                                     f"{type(e).__name__}: {e}") from None
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        procs = []
        for rank, actor, (node_id, pid) in zip(ranks, actors, places):
            node_ip = addresses.get(node_id, "?")
            run_ref = actor.run.remote(self.config, rank, input_addr, output_addr)
            logger.info("Engine core %d: Ray actor on node %s (%s), pid %d, %d CPU(s).",
                        rank, node_id, node_ip, pid, self.cpus)
            procs.append(RayEngineProcess(actor, run_ref, rank, node_id, node_ip, pid))
        return procs

    def close(self) -> None:
        """Removes the placement group (after the actors are stopped), then leaves the
        cluster this manager joined; a local cluster it started stops with it."""
        import ray

        if not ray.is_initialized():
            return
        try:
            ray.util.remove_placement_group(self.placement_group)
        except Exception:  # the cluster is going away with this process
            pass
        if self.initialized_ray:
            ray.shutdown()


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EngineStartupError("data_parallel_backend='ray' needs Ray: pip install 'pagellm[ray]'.") from None
    return ray
