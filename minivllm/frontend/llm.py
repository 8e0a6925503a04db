"""`LLM`: the offline API — a batch of prompts in, `RequestOutput`s out, in input order."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from minivllm.config import EngineArgs
from minivllm.frontend.clients.dp_group import DEFAULT_FAILOVER_LIMIT
from minivllm.frontend.input_processor import PromptType
from minivllm.frontend.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate for a batch of prompts, vLLM's way: `LLM(model=...).generate(prompts, params)`.
    The engine ends with the LLM (see `shutdown`); `with LLM(...) as llm:` scopes it."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {sorted(unknown)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()

    @classmethod
    def connect(
        cls,
        address: str | list[str],
        curve: CurveClientKeys | None = None,
        tokenizer: str | None = None,
        data_parallel_failover_limit: int = DEFAULT_FAILOVER_LIMIT,
    ) -> LLM:
        """Attach to a running `minivllm engine-core` daemon (or a list of them, requests
        routed over all) instead of starting an engine; `shutdown()` (or leaving `with`, or
        the end of the script) then detaches and leaves the daemons running. `curve`: the
        keys a daemon on a network address asks for (`CurveClientKeys.load(server_key,
        secret_key)`). No model files are needed here: the daemon sends its tokenizer,
        limits and sampling defaults; `tokenizer`: a directory to load the tokenizer from
        instead. Over several daemons, a request whose daemon dies goes on on another,
        unless `data_parallel_failover_limit` daemons have died holding it."""
        llm = cls.__new__(cls)
        llm.engine_args = None
        llm.llm_engine = LLMEngine.connect(address, curve, tokenizer, data_parallel_failover_limit)
        llm._counter = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params `generate` and `chat` use when given none: the model's
        generation-config defaults (`generation_config="auto"`), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.model_config.default_sampling_params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                request_id = str(next(self._counter))
                # only the final output is wanted: no per-step copies of growing outputs
                params = msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.llm_engine.input_processor.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(request_ids)) if use_tqdm else None
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar:
                            bar.update(out)
        except BaseException:
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if bar:
                bar.close()
        return [finished[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (as vLLM's); False while requests still hold some."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine (or detach from the daemon). Optional: it also happens when the
        LLM is garbage-collected, at interpreter exit, and on leaving `with LLM(...) as llm:`."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


class _ProgressBar:
    """tqdm bar with vLLM's postfix: 'est. speed input: X toks/s, output: Y toks/s'."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.in_tokens = 0
        self.out_tokens = 0

    def update(self, out: RequestOutput) -> None:
        self.in_tokens += len(out.prompt_token_ids or [])
        self.out_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.postfix = (
            f"est. speed input: {self.in_tokens / elapsed:.2f} toks/s, "
            f"output: {self.out_tokens / elapsed:.2f} toks/s"
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
