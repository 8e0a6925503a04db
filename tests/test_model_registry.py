"""`ModelRegistry.register_model`: a model from outside the package runs in the engine's
processes, registered in code (carried to every spawned process) or by a plugin; what cannot
be registered or imported is refused with a message naming it."""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineArgs, ModelRegistry, SamplingParams
from tests.out_of_tree_model import ARCHITECTURE
from tests.tiny_models import build_null_checkpoint

COUNTING = "tests.out_of_tree_model:CountingForCausalLM"


@pytest.fixture
def registry(monkeypatch):
    """The process's registry, as it was again after the test."""
    monkeypatch.setattr(ModelRegistry, "_models", dict(ModelRegistry._models))
    monkeypatch.setattr(ModelRegistry, "_plugins_loaded", ModelRegistry._plugins_loaded)
    return ModelRegistry


def test_a_model_registered_in_code_runs_in_the_engines_processes(
    registry, tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv("MINIVLLM_PLUGINS")  # only this process's memory knows the model
    registry.register_model(ARCHITECTURE, COUNTING)
    model = build_null_checkpoint(str(tmp_path), architectures=[ARCHITECTURE])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model=model) as llm:  # an engine-core process, which spawns a worker process
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == [8, 9, 10, 11]


def test_what_does_not_load_is_named(registry, tmp_path) -> None:
    from minivllm.worker.models.registry import resolve_architecture

    def model_config(architecture: str):
        path = build_null_checkpoint(str(tmp_path / architecture), architectures=[architecture])
        return EngineArgs(model=path).create_engine_config().model

    registry.register_model(ARCHITECTURE, COUNTING)
    cls, _ = resolve_architecture(model_config(ARCHITECTURE))
    assert f"{cls.__module__}:{cls.__qualname__}" == COUNTING
    with pytest.raises(ValueError, match="'NoSuchForCausalLM' is not supported; supported: "):
        resolve_architecture(model_config("NoSuchForCausalLM"))
    registry.register_model("MissingForCausalLM", "tests.out_of_tree_model:Missing")
    with pytest.raises(
        ValueError,
        match="'MissingForCausalLM' is registered as 'tests.out_of_tree_model:Missing', which "
        "does not import: AttributeError",
    ):
        resolve_architecture(model_config("MissingForCausalLM"))


def test_plugins_register_first_and_code_overrides_them(registry, monkeypatch) -> None:
    def fresh_process(plugins: str) -> None:  # a process that has not read its registry yet
        monkeypatch.setenv("MINIVLLM_PLUGINS", plugins)
        monkeypatch.setattr(registry, "_models", {})
        monkeypatch.setattr(registry, "_plugins_loaded", False)

    fresh_process("tests.out_of_tree_model:register")
    assert registry.registered() == {ARCHITECTURE: COUNTING}
    registry.register_model(ARCHITECTURE, "tests.elsewhere:Counting")
    assert registry.get_supported_archs() == [ARCHITECTURE]
    assert registry.registered()[ARCHITECTURE] == "tests.elsewhere:Counting"  # plugins run once
    fresh_process("tests.out_of_tree_model:nothing")
    with pytest.raises(ValueError, match=r"MINIVLLM_PLUGINS: 'tests.out_of_tree_model:nothing' "):
        registry.registered()
    fresh_process("tests.out_of_tree_model")
    with pytest.raises(ValueError, match="is not 'module:function'"):
        registry.registered()


def test_registrations_another_process_cannot_import_are_refused(registry) -> None:
    class Local:
        pass

    with pytest.raises(ValueError, match="architecture must be a non-empty string"):
        registry.register_model("", COUNTING)
    with pytest.raises(ValueError, match="model_cls must be 'module:Class', got 'counting'"):
        registry.register_model(ARCHITECTURE, "counting")
    with pytest.raises(ValueError, match="cannot be imported by name .* defined in a function"):
        registry.register_model(ARCHITECTURE, Local)
    in_main = type("InMain", (), {"__module__": "__main__"})
    with pytest.raises(ValueError, match=r"defined in __main__\); define it in a module"):
        registry.register_model(ARCHITECTURE, in_main)
    assert ARCHITECTURE not in registry.registered()
