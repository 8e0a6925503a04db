"""Workers as Ray actors (`distributed_executor_backend="ray"`), so a tensor-parallel group,
or the engine-cores of data parallelism, can span the nodes of a Ray cluster.

Ray only places and watches the workers: one placement group per engine-core, one bundle
per rank (a GPU and a CPU, or a CPU), packed onto as few nodes as fit. Everything else is
`MultiprocExecutor`'s: the same msgspec frames over ZeroMQ (here tcp on this node's
address, which the actors connect to), tensors between ranks over torch.distributed (rank 0
hosts the rendezvous store on its node's address). The actors get the config as msgpack
bytes, the model registrations and socket addresses as strings; nothing of ours is pickled.

A dead rank: its actor's `run` call fails (Ray reports the actor's death to its owner, this
engine-core), the poll that finds no step result sees it, and the engine fails as with a
dead worker process; shutdown kills every actor and removes the placement group. Should the
engine-core itself die, Ray ends the actors it owns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import msgspec

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine_core.multiproc_executor import MultiprocExecutor
from minivllm.exceptions import EngineStartupError
from minivllm.logging_utils import configure_process_logging
from minivllm.model_registry import ModelRegistry
from minivllm.protocol import transport

logger = logging.getLogger(__name__)

NAMESPACE = "minivllm"  # where the worker actors are named (`minivllm-<core pid>-rank<r>`)
# what the workers should see of the engine-core's environment, on any node
_FORWARDED_ENV = ("MINIVLLM_", "NCCL_", "GLOO_", "TORCH_", "NVSHMEM_", "OMP_", "HF_")


class RayWorker:
    """The actor hosting one worker rank: `run` is the worker loop of a worker process."""

    def __init__(self, env: dict[str, str], models: dict[str, str]) -> None:
        os.environ.update(env)  # before torch loads (OpenMP reads its settings then)
        ModelRegistry.restore(models)  # the engine-core's (a spawned process's, see spawn)

    def pid(self) -> int:
        return os.getpid()

    def run(self, config: bytes, rank: int, step_address: str, result_address: str) -> None:
        import ray

        from minivllm.worker.worker_process import serve

        configure_process_logging(f"worker-rank{rank}")
        engine_config = msgspec.msgpack.decode(config, type=EngineConfig)
        host = ray.util.get_node_ip_address()
        serve(engine_config, rank, step_address, result_address, store_host=host)


def connect_ray():
    """Join the Ray cluster (RAY_ADDRESS, else the one `ray start` made here, else a new
    local one), keeping this process's SIGTERM handler, which `ray.init` replaces."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'minivllm[ray]'"
        ) from None
    if not ray.is_initialized():
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(namespace=NAMESPACE, logging_level=logging.WARNING)
        if main:
            signal.signal(signal.SIGTERM, previous)
    return ray


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self.ray = connect_ray()
        self.host = self.ray.util.get_node_ip_address()
        self.placement = None
        self.actors: list = []
        self.runs: list = []  # each actor's `run` call: it ends when the actor dies
        super().__init__(config)

    def _address(self, name: str) -> str:
        return transport.tcp_address(self.host, 0)

    def _start_workers(self, step_addrs: list[str], result_addr: str) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, tp = self.ray, len(step_addrs)
        gpus = 1 if self.config.device.device == "cuda" else 0
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
        self.placement = placement_group([bundle] * tp, strategy="PACK")
        timeout_s = envs.ray_placement_timeout_s()
        ready, _ = ray.wait([self.placement.ready()], timeout=timeout_s)
        if not ready:
            raise EngineStartupError(
                f"the Ray cluster found no room for {tp} worker(s) of {bundle} in "
                f"{timeout_s:.0f} s (free: {ray.available_resources()})"
            )
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        config = msgspec.msgpack.encode(self.config)
        actor_class = ray.remote(RayWorker)
        for rank, addr in enumerate(step_addrs):
            actor = actor_class.options(
                name=f"minivllm-{os.getpid()}-rank{rank}",
                num_cpus=1,
                num_gpus=gpus,
                max_restarts=0,
                max_concurrency=2,  # `pid` answers while `run` loops
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank
                ),
            ).remote(env, ModelRegistry.registered())
            self.actors.append(actor)
            self.runs.append(actor.run.remote(config, rank, addr, result_addr))

    def _dead_worker(self) -> str | None:
        done, _ = self.ray.wait(self.runs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.runs.index(done[0])
        try:
            self.ray.get(done[0], timeout=0)
        except Exception as e:  # noqa: BLE001 - the actor's death, told as Ray tells it
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"worker rank {rank} (Ray actor minivllm-{os.getpid()}-rank{rank}) died: {cause}"
        return f"worker rank {rank} (Ray actor) left its loop"

    def _stop_workers(self, graceful: bool) -> None:
        if graceful and self.runs:
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=2.0)
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone is fine
                logger.debug("ray.kill: %s", e)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
            self.placement = None
        if self.runs:  # until the actors' ends are seen
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=5.0)
