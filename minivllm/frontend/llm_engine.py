"""`LLMEngine`: vLLM's synchronous step loop — add requests, `step()`, read `RequestOutput`s."""

from __future__ import annotations

from concurrent.futures import Future

from minivllm.config import EngineArgs, EngineConfig, ModelConfig
from minivllm.exceptions import EngineCoreDeadError
from minivllm.frontend.clients.core_client import EngineCoreClient, InprocClient
from minivllm.frontend.clients.dp_client import attach_client, make_client
from minivllm.frontend.clients.dp_group import DEFAULT_FAILOVER_LIMIT
from minivllm.frontend.input_processor import InputProcessor, PromptType
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.tokenizer import Tokenizer, load_tokenizer_meanwhile, resolve_tokenizer
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

    def __init__(
        self,
        model_config: ModelConfig,
        client: EngineCoreClient,
        tokenizer: Tokenizer | Future[Tokenizer | None] | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        """`tokenizer`: None loads the model's (unless `skip_tokenizer_init`), a future is
        waited for (a failed load stops the engine); `config`: the
        whole engine's when this frontend started it (None when attached to a daemon)."""
        self.config = config
        self.engine_core = client
        self._release = on_release(self, client.shutdown)
        try:
            self.model_config = model_config
            self.tokenizer = resolve_tokenizer(
                tokenizer, model_config.tokenizer, model_config.skip_tokenizer_init
            )
            self.input_processor = InputProcessor(model_config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer, model_config.stream_interval)
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        config = engine_args.create_engine_config()
        model = config.model
        tokenizer = load_tokenizer_meanwhile(None if model.skip_tokenizer_init else model.tokenizer)
        if config.parallel.distributed_executor_backend == "uni":
            client: EngineCoreClient = InprocClient(config)
        else:
            client = make_client(config, asynchronous=False)
        return cls(model, client, tokenizer, config)

    @classmethod
    def connect(
        cls,
        address: str | list[str],
        curve: CurveClientKeys | None = None,
        tokenizer: str | None = None,
        data_parallel_failover_limit: int = DEFAULT_FAILOVER_LIMIT,
    ) -> LLMEngine:
        """Attach to a running `minivllm engine-core` daemon at `address`, or to several
        (a list: requests routed over them as with data parallelism, and moved to another
        when theirs dies). The model's config and tokenizer come from the daemon;
        `tokenizer`: a directory to load it from instead."""
        client = attach_client(
            address,
            curve,
            asynchronous=False,
            has_tokenizer=bool(tokenizer),
            failover_limit=data_parallel_failover_limit,
        )
        try:
            model_config, loaded = client.attached_model(tokenizer)
        except BaseException:
            client.shutdown()
            raise
        return cls(model_config, client, loaded)

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
            # requests that failed with a dead engine-core (the rest moved on): they end
            # here, the others' steps go on
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
