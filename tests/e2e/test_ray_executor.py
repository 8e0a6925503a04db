"""Workers as Ray actors on a local Ray cluster: the tokens of one in-process worker, and a
killed actor fails the engine as a killed worker process does."""

from __future__ import annotations

import os

import psutil
import pytest
import ray

from minivllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from minivllm.engine_core.ray_executor import NAMESPACE
from tests.hf_reference import parity_prompts
from tests.process_helpers import spawned_children, stream_until_killed, wait_gone


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for the module (Ray takes seconds to start); engine-cores find it
    through RAY_ADDRESS."""
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield
    del os.environ["RAY_ADDRESS"]
    ray.shutdown()


def _worker_actors() -> list[str]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["name"].startswith("minivllm-"))


def test_tp2_over_ray_equals_tp1(ray_cluster, qwen3_dir: str) -> None:
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    finally:
        one.shutdown()

    llm = LLM(
        qwen3_dir, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        core = spawned_children(os.getpid())[0]
        assert spawned_children(core) == [], "the workers are Ray actors, not child processes"
        assert [a.split("-")[-1] for a in _worker_actors()] == ["rank0", "rank1"]
        outputs = llm.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()
    assert wait_gone([core], timeout=15) == []
    assert _worker_actors() == []


def test_killed_actor_fails_every_caller(ray_cluster, qwen3_dir: str) -> None:
    args = EngineArgs(model=qwen3_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    llm = AsyncLLM.from_engine_args(args)
    core = spawned_children(os.getpid())[0]
    actors = [ray.get_actor(name, namespace=NAMESPACE) for name in _worker_actors()]
    pids = ray.get([a.pid.remote() for a in actors])
    try:
        results, waited = stream_until_killed(llm, lambda: ray.kill(actors[1]), max_tokens=400)
    finally:
        llm.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "worker rank" in str(results[0])
    assert waited < 5.0
    assert wait_gone([core, *pids], timeout=15) == []
    assert _worker_actors() == []
    assert not any(p.pid in pids for p in psutil.process_iter())
