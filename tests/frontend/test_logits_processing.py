"""Penalties, logit bias, allowed token ids, bad words and min_tokens, as vLLM defines them.

The engine runs with logprobs_mode="processed_logprobs", so each position's logprobs are
those of the logits after processing: the tests rebuild those logits from transformers' raw
logits and the definitions written here, and compare the greedy token and its logprobs.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.hf_reference import hf_logits, parity_prompts

TOL = 1e-4


@pytest.fixture(scope="module")
def llm(qwen3_dir: str):
    llm = LLM(
        qwen3_dir,
        dtype="float32",
        distributed_executor_backend="uni",
        logprobs_mode="processed_logprobs",
    )
    yield llm
    llm.shutdown()


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams):
    """The definitions: repetition over prompt and output tokens (positive logits divided,
    the others multiplied), frequency and presence over output tokens only."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    for t in set(output):
        logits[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, bias in (p.logit_bias or {}).items():
        logits[t] += bias
    return logits


@pytest.mark.parametrize(
    "settings",
    [
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=-1.5),
        dict(frequency_penalty=2.0),
        dict(presence_penalty=-2.0),
        dict(presence_penalty=1.0),
        dict(repetition_penalty=0.8, frequency_penalty=-0.7, presence_penalty=0.4),
        dict(logit_bias={7: 3.0, 64: -5.0, 131: 2.5}),
    ],
    ids=lambda s: ",".join(s),
)
def test_each_setting_equals_its_definition(llm: LLM, qwen3_dir: str, settings: dict) -> None:
    prompts = parity_prompts()[:3]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True, **settings)
    plain = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    # the plain request shares the batch: settings are per request
    batch = [{"prompt_token_ids": p} for p in prompts] * 2
    outs = llm.generate(batch, [params] * 3 + [plain] * 3, use_tqdm=False)
    changed = 0
    for i, out in enumerate(outs):
        prompt, p = prompts[i % 3], params if i < 3 else plain
        tokens = out.outputs[0].token_ids
        logits = hf_logits(qwen3_dir, prompt + tokens)[len(prompt) - 1 : -1]
        for step, (entry, row) in enumerate(zip(out.outputs[0].logprobs, logits, strict=True)):
            ref = penalized(row, prompt, tokens[:step], p)
            assert tokens[step] == int(ref.argmax())
            ref = ref.log_softmax(-1)
            for t, lp in entry.items():
                assert abs(lp.logprob - ref[t].item()) < TOL
            changed += i < 3 and tokens[step] != int(row.argmax())
    assert changed, "the setting never changed a token: the test would prove nothing"


def test_allowed_token_ids_are_the_only_ones(llm: LLM) -> None:
    allowed = [5, 17, 42, 300]
    params = SamplingParams(temperature=1.0, max_tokens=40, allowed_token_ids=allowed, seed=1)
    outs = llm.generate([parity_prompts()[0], parity_prompts()[1]], params, use_tqdm=False)
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1


def test_min_tokens_masks_eos_and_stop_ids_until_reached(llm: LLM) -> None:
    eos = 0  # the tiny models' EOS, made the likeliest token by far
    prompt = {"prompt_token_ids": parity_prompts()[2]}
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 30.0})
    )[0].outputs[0]
    assert out.token_ids == [*out.token_ids[:4], eos] and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"
    # ignore_eos: EOS is still masked while min_tokens is not reached (vLLM's meaning)
    out = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=6, min_tokens=3, logit_bias={eos: 30.0}, ignore_eos=True
        ),
    )[0].outputs[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos] * 3
    stop = 99
    out = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=10, min_tokens=5, stop_token_ids=[stop], logit_bias={stop: 30}
        ),
    )[0].outputs[0]
    assert stop not in out.token_ids[:5] and out.token_ids[5] == stop
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_bad_words_never_appear(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:4]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # words the plain run says, whose text tokenizes back to the same ids
    words = []
    for tokens in plain:
        for n in (1, 2):
            text = tok.decode(tokens[2 : 2 + n])
            if text.strip() and tok.encode(text, add_special_tokens=False) == tokens[2 : 2 + n]:
                words.append(text)
    assert words
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words)
    outs = llm.generate(prompts, params, use_tqdm=False)
    banned = []
    for word in words:  # with and without a leading space, as vLLM tokenizes them
        for text in (word.lstrip(), " " + word.lstrip()):
            banned.append(tok.encode(text, add_special_tokens=False))
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 12
        for seq in banned:
            assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids))), (seq, ids)
    assert [o.outputs[0].token_ids for o in outs] != plain


INVALID = [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logprobs=-2), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),  # the whole vocabulary, above max_logprobs
    (dict(prompt_logprobs=-5), "prompt_logprobs"),
    (dict(prompt_logprobs=30), "prompt_logprobs"),
    (dict(logit_bias={100000: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(min_tokens=-1), "min_tokens"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_values_raise_value_errors_naming_the_field(
    llm: LLM, kwargs: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([1, 2, 3], SamplingParams(**kwargs), use_tqdm=False)
    # the engine is unharmed
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs


def test_engine_args_for_logprobs_are_validated(qwen3_dir: str) -> None:
    from minivllm import EngineArgs

    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineArgs(model=qwen3_dir, logprobs_mode="logits")
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(model=qwen3_dir, max_logprobs=-3)


def test_settings_survive_preemption_and_chunked_prefill(llm: LLM, qwen3_dir: str) -> None:
    """A preempted request is recomputed with its output so far: its penalty counts, min
    tokens and bad-word matches continue where they were."""
    settings = SamplingParams(
        temperature=0,
        max_tokens=14,
        repetition_penalty=0.7,
        frequency_penalty=-0.5,
        min_tokens=6,
        bad_words=["a"],
        logit_bias={0: 5.0},
        logprobs=2,
    )
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()]
    calm = llm.generate(prompts, settings, use_tqdm=False)
    pressed = LLM(
        qwen3_dir,
        dtype="float32",
        distributed_executor_backend="uni",
        logprobs_mode="processed_logprobs",
        num_gpu_blocks_override=24,
        block_size=4,
        max_model_len=96,
        max_num_batched_tokens=16,
    )
    try:
        outs = pressed.generate(prompts, settings, use_tqdm=False)
        stats = pressed.llm_engine.engine_core.core.stats()
    finally:
        pressed.shutdown()
    assert stats["num_preemptions"] >= 1
    for a, b in zip(calm, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(x) == list(y)
            assert all(abs(x[t].logprob - y[t].logprob) < TOL for t in x)
