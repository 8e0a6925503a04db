"""Structured outputs in the engine-core, in process: at temperature 1.0 on a tiny random
checkpoint, every output is a sentence of its grammar, through async scheduling, chunked
prefill, preemption and prefix caching; grammars compile without holding back the batch; a
grammar that does not compile fails its request only."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.engine_core.structured_output.grammar import GrammarCompiler
from minivllm.protocol.messages import EngineCoreRequest, FinishReason
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.structured_outputs import StructuredOutputsParams
from tests.structured_cases import check_text, constraints, grammar_accepts, json_object_params
from tests.tiny_models import VOCAB_SIZE

EOS = [0]


def make_core(model: str, **kwargs) -> EngineCore:
    args = EngineArgs(model=model, distributed_executor_backend="uni", max_model_len=512, **kwargs)
    return EngineCore(args.create_engine_config())


def request(
    req_id: str, prompt: list[int], so: StructuredOutputsParams | None, **kwargs
) -> EngineCoreRequest:
    params = SamplingParams(temperature=1.0, max_tokens=kwargs.pop("max_tokens", 120), **kwargs)
    params.structured_outputs = so
    return EngineCoreRequest(req_id, prompt, params, eos_token_ids=EOS)


def run(core: EngineCore, max_steps: int = 5000) -> dict[str, dict]:
    """Step until idle: each request's tokens, finish reason and error."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return results
        for outputs in core.step().values():
            for out in outputs.outputs:
                r = results.setdefault(out.request_id, {"tokens": [], "finish": None})
                r["tokens"] += out.new_token_ids
                r["finish"], r["error"] = out.finish_reason, out.error
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: str):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def check_all(results: dict[str, dict], tokenizer, kinds: dict[str, str]) -> None:
    for req_id, kind in kinds.items():
        r = results[req_id]
        assert r["finish"] == FinishReason.STOP, (req_id, r)
        assert r["tokens"][-1] in EOS
        check_text(kind, tokenizer.decode(r["tokens"], skip_special_tokens=True))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_output_follows_its_grammar(qwen3_dir, tokenizer, async_scheduling) -> None:
    core = make_core(qwen3_dir, async_scheduling=async_scheduling)
    kinds = {}
    try:
        for i in range(4):
            for kind, so in constraints().items():
                req_id = f"{kind}-{i}"
                kinds[req_id] = kind
                core.add_request(request(req_id, [5 + i, 9, 30 + i], so, seed=i))
        core.add_request(request("free", [5, 9, 30], None, max_tokens=20, ignore_eos=True))
        params = json_object_params(tokenizer, seed=1)
        core.add_request(EngineCoreRequest("json_object", [5, 9], params, eos_token_ids=EOS))
        kinds["json_object"] = "json_object"
        results = run(core)
    finally:
        core.shutdown()
    check_all(results, tokenizer, kinds)
    assert len(results["free"]["tokens"]) == 20


def test_preemption_chunked_prefill_and_prefix_caching(qwen3_dir, tokenizer) -> None:
    """Few KV blocks (requests are preempted and recomputed), prompts longer than a step's
    token budget (chunked), a shared prefix (served from the cache): the matchers follow
    every request's tokens through all of it."""
    core = make_core(
        qwen3_dir, block_size=16, num_gpu_blocks_override=16, max_num_batched_tokens=64
    )
    shared = list(range(40, 120))  # 80 tokens: five full blocks
    kinds = {}
    try:
        for i in range(8):
            kind = ("json", "ebnf", "regex", "choice")[i % 4]
            kinds[str(i)] = kind
            core.add_request(request(str(i), [*shared, 200 + i], constraints()[kind], seed=i))
        results = run(core)
        stats = core.stats()
    finally:
        core.shutdown()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    check_all(results, tokenizer, kinds)


def test_max_tokens_ends_inside_the_structure(qwen3_dir, tokenizer) -> None:
    core = make_core(qwen3_dir)
    try:
        so = constraints()["json"]
        core.add_request(request("short", [5, 9], so, max_tokens=6, seed=3))
        results = run(core)
    finally:
        core.shutdown()
    r = results["short"]
    assert r["finish"] == FinishReason.LENGTH and len(r["tokens"]) == 6
    assert tokenizer.decode(r["tokens"]).startswith('{"id":')  # the object unfinished
    assert grammar_accepts(qwen3_dir, VOCAB_SIZE, so, r["tokens"])


def test_a_grammar_that_fails_ends_its_request_only(qwen3_dir, tokenizer) -> None:
    """The frontend rejects these; a client that skips it gets an error output."""
    core = make_core(qwen3_dir)
    bad = StructuredOutputsParams(regex="(unclosed")
    worse = StructuredOutputsParams(grammar='root ::= "a" missing_rule')
    try:
        core.add_request(request("bad", [5, 9], bad))
        core.add_request(request("good", [5, 9], constraints()["choice"], seed=1))
        core.add_request(request("worse", [5, 9], worse))
        results = run(core)
        # and the engine keeps serving
        core.add_request(request("after", [5, 9], constraints()["regex"], seed=2))
        results.update(run(core))
    finally:
        core.shutdown()
    for req_id in ("bad", "worse"):
        assert results[req_id]["finish"] == FinishReason.ERROR and not results[req_id]["tokens"]
    assert "parenthesis is not closed" in results["bad"]["error"]
    assert 'Rule "missing_rule" is not defined' in results["worse"]["error"]
    check_all(results, tokenizer, {"good": "choice", "after": "regex"})


def test_a_compiling_grammar_does_not_hold_back_the_batch(qwen3_dir, tokenizer, monkeypatch):
    """While one grammar compiles, requests behind it run, free and constrained alike."""
    release = threading.Event()
    compile_grammar = GrammarCompiler.compile

    def slow_compile(self, spec):
        if spec.text.startswith("[0-9]"):
            assert release.wait(60)
        return compile_grammar(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    core = make_core(qwen3_dir)
    try:
        core.add_request(request("slow", [5, 9], StructuredOutputsParams(regex="[0-9]{3}")))
        core.add_request(request("choice", [5, 9], constraints()["choice"], seed=1))
        core.add_request(request("free", [5, 9], None, max_tokens=8, ignore_eos=True))
        finished: set[str] = set()
        for _ in range(1000):
            for outputs in core.step().values():
                finished |= {o.request_id for o in outputs.outputs if o.finish_reason is not None}
            if finished >= {"choice", "free"}:
                break
        assert finished == {"choice", "free"}  # the slow one still waits for its grammar
        release.set()
        rest = run(core)
    finally:
        release.set()
        core.shutdown()
    assert rest["slow"]["finish"] == FinishReason.STOP
    assert tokenizer.decode(rest["slow"]["tokens"], skip_special_tokens=True).isdigit()


def test_the_grammar_compiler_is_built_for_the_first_grammar_only(
    qwen3_dir, tokenizer, monkeypatch
):
    """Its build (xgrammar's import brings transformers' and torch's: seconds holding the
    GIL) never runs beside the steps of an engine that sees no structured request."""
    builds = []
    build = GrammarCompiler.__init__

    def counted(self, *args):
        builds.append(args)
        build(self, *args)

    monkeypatch.setattr(GrammarCompiler, "__init__", counted)
    core = make_core(qwen3_dir)
    try:
        core.add_request(request("free", [5, 9], None, max_tokens=8, ignore_eos=True))
        run(core)
        assert builds == []
        for i in range(2):
            core.add_request(request(f"choice-{i}", [5, 9], constraints()["choice"], seed=i))
        results = run(core)
    finally:
        core.shutdown()
    assert len(builds) == 1
    check_all(results, tokenizer, {"choice-0": "choice", "choice-1": "choice"})


def test_a_reused_id_is_refused_and_leaves_the_first_request_alone(qwen3_dir, tokenizer):
    """Refused before anything is made for it: the first request's grammar stays its own."""
    core = make_core(qwen3_dir)
    outs = []
    try:
        core.add_request(request("a", [5, 9], constraints()["choice"], seed=1))
        core.add_request(request("a", [5, 9], constraints()["regex"], seed=2))
        for _ in range(1000):
            if not core.has_work():
                break
            for outputs in core.step().values():
                outs += outputs.outputs
    finally:
        core.shutdown()
    errors = [o.error for o in outs if o.finish_reason == FinishReason.ERROR]
    assert len(errors) == 1 and "request id 'a' is already in use" in errors[0]
    first = [o for o in outs if o.finish_reason != FinishReason.ERROR]
    assert first[-1].finish_reason == FinishReason.STOP
    tokens = [t for o in first for t in o.new_token_ids]
    check_text("choice", tokenizer.decode(tokens, skip_special_tokens=True))


def test_unconstrained_steps_carry_no_bitmask(qwen3_dir, monkeypatch) -> None:
    from minivllm.worker import sampler

    def refuse(*args):
        raise AssertionError("a bitmask was applied in a step without structured outputs")

    monkeypatch.setattr(sampler, "apply_token_bitmask", refuse)
    core = make_core(qwen3_dir)
    sent = []
    sample_tokens = core.executor.sample_tokens

    def record(bitmask):  # noqa: ANN001, ANN202
        sent.append(bitmask)
        return sample_tokens(bitmask)

    monkeypatch.setattr(core.executor, "sample_tokens", record)
    try:
        core.add_request(request("free", [5, 9], None, max_tokens=8, ignore_eos=True))
        results = run(core)
    finally:
        core.shutdown()
    assert len(results["free"]["tokens"]) == 8
    assert sent and all(bitmask is None for bitmask in sent)
    assert core.executor.worker.model_runner.grammar_bitmasks is None


def test_grammars_are_cached_by_their_spec_within_a_byte_budget(qwen3_dir, monkeypatch) -> None:
    from minivllm.engine_core.structured_output import manager as m

    compiled: list[str] = []
    compile_grammar = GrammarCompiler.compile

    def counting(self, spec):
        compiled.append(spec.text)
        return compile_grammar(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", counting)
    manager = m.StructuredOutputManager(qwen3_dir, VOCAB_SIZE, 8)

    class Req:
        def __init__(self, i: int) -> None:
            self.request_id = str(i)
            self.output_token_ids: list[int] = []  # none carried (not a continuation)

    reqs = [Req(i) for i in range(4)]
    try:
        a, b = (
            StructuredOutputsParams(regex="a+").spec(),
            StructuredOutputsParams(regex="b+").spec(),
        )
        manager.add_request(reqs[0], a, EOS)
        manager.add_request(reqs[1], a, EOS)  # the same spec: the same compile
        assert reqs[0].structured_output.grammar is reqs[1].structured_output.grammar
        reqs[0].structured_output.grammar.result(timeout=60)
        assert manager.poll({r.request_id: r for r in reqs[:2]}) == []
        assert reqs[0].structured_output.matcher is not reqs[1].structured_output.matcher
        manager.cache_bytes = 1  # room for none: the oldest compiled goes
        manager.add_request(reqs[2], b, EOS)
        reqs[2].structured_output.grammar.result(timeout=60)
        manager.add_request(reqs[3], a, EOS)
        reqs[3].structured_output.grammar.result(timeout=60)
    finally:
        manager.shutdown()
    assert compiled == ["a+", "b+", "a+"]
