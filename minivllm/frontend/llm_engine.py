"""`LLMEngine`: vLLM's synchronous step loop — add requests, `step()`, read `RequestOutput`s."""

from __future__ import annotations

from minivllm.config import EngineArgs, EngineConfig
from minivllm.exceptions import EngineCoreDeadError
from minivllm.frontend.core_client import EngineCoreClient, InprocClient
from minivllm.frontend.dp_client import attach_client, make_client
from minivllm.frontend.input_processor import InputProcessor, PromptType
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.tokenizer import load_tokenizer
from minivllm.outputs import RequestOutput
from minivllm.process_utils import on_release
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.messages import UtilityMethod
from minivllm.protocol.sampling_params import SamplingParams


class LLMEngine:
    """Tokenizes on the way in, detokenizes on the way out; the engine-core does the rest,
    in its own process by default (`distributed_executor_backend='uni'` keeps it in this one).

    The engine it started stops (an attached daemon is left) on `shutdown()`, when nothing
    refers to the LLMEngine any more, or at interpreter exit, whichever comes first. A
    given `client` is owned from here on, also when this constructor fails."""

    def __init__(self, config: EngineConfig, client: EngineCoreClient | None = None) -> None:
        self.config = config
        model = config.model
        try:
            self.tokenizer = None if model.skip_tokenizer_init else load_tokenizer(model.tokenizer)
            self.input_processor = InputProcessor(model, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            if client is not None:
                client.shutdown()
            raise
        if client is None and config.parallel.distributed_executor_backend == "uni":
            client = InprocClient(config)
        self.engine_core = client or make_client(config, asynchronous=False)
        self._release = on_release(self, self.engine_core.shutdown)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    @classmethod
    def connect(cls, address: str | list[str], curve: CurveClientKeys | None = None) -> LLMEngine:
        """Attach to a running `minivllm engine-core` daemon at `address`, or to several
        (a list: requests routed over them as with data parallelism)."""
        client = attach_client(address, curve, asynchronous=False)
        try:
            config = client.engine_config()
        except BaseException:
            client.shutdown()
            raise
        return cls(config, client=client)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue one request; raises ValueError (naming the parameter) if invalid."""
        requests = self.output_processor.add_user_request(
            request_id, prompt, params, self.input_processor, arrival_time
        )
        self.engine_core.add_requests(requests)

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, and return what changed."""
        try:
            outputs = self.engine_core.get_output()
        except EngineCoreDeadError as e:
            # one of several cores died: its requests end here, the others' steps go on
            self.output_processor.forget_lost(e.request_ids)
            raise
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if processed.errors:
            request_id, error = next(iter(processed.errors.items()))
            raise ValueError(f"request {request_id} failed: {error}")
        return processed.request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        internal = self.output_processor.abort_user_requests(ids)
        if internal:
            self.engine_core.abort_requests(internal)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility(UtilityMethod.RESET_PREFIX_CACHE)

    def get_stats(self) -> dict:
        return self.engine_core.call_utility(UtilityMethod.STATS)

    def shutdown(self) -> None:
        self._release()
