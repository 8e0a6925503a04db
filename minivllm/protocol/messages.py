"""Wire types between frontend, engine-core and workers.

Every message is a msgspec Struct; `serial.py` tags each with a one-byte type and decodes it
into exactly the declared type, so nothing on any socket is ever unpickled.

Start-up, as it travels:

    client       ClientHello ──► core (input socket)  ──► EngineCoreInfo
                 ClientHello ──► core (output socket) ──► RouteReady; then Heartbeats both ways
    worker 0     Rendezvous (its TCPStore, TP only) ──► core ──► Rendezvous to the other ranks
    each worker  WorkerLoaded ──► core ──► InitKVCache (the smallest count) ──► WorkerReady
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
import numpy as np

from minivllm.protocol.limits import (
    MAX_TOKENIZER_FILES,
    AbortIds,
    AllStopTokenIds,
    EosTokenIds,
    ModelConfigBytes,
    OutputTokenIds,
    PromptTokenIds,
    RequestId,
    TokenizerFileData,
    TokenizerFileName,
)
from minivllm.protocol.sampling_params import SamplingParams

PROTOCOL_VERSION = 6


class FinishReason(enum.IntEnum):
    """Why a request ended; `str()` gives vLLM's spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # cancelled by the client or the engine
    ERROR = 3  # the request itself failed (the engine lives on)

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class LogprobsArrays(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of n positions, one row each: column 0 is the position's own token (sampled,
    or the prompt's next token), then the top-k by logprob (k may be 0). On the wire the
    arrays are raw little-endian buffers (see serial.py), never Python objects per token."""

    token_ids: np.ndarray  # int32 [n, 1 + k]
    logprobs: np.ndarray  # float32 [n, 1 + k]: logprobs, or logits for the *_logits modes
    ranks: np.ndarray  # int32 [n]: of the own token, how many tokens score at least as high

    def rows(self, start: int, stop: int) -> LogprobsArrays:
        return LogprobsArrays(
            self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop]
        )

    @staticmethod
    def concat(parts: list[LogprobsArrays]) -> LogprobsArrays:
        """The rows of all parts; narrower parts are padded (ids -1, logprobs -inf) to the
        widest, which a reader never looks at: each request reads its own top-k."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.token_ids.shape[1] for p in parts)
        return LogprobsArrays(
            np.concatenate([_pad(p.token_ids, width, -1) for p in parts]),
            np.concatenate([_pad(p.logprobs, width, -np.inf) for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


def _pad(a: np.ndarray, width: int, value: float) -> np.ndarray:
    if a.shape[1] == width:
        return a
    return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)


# ---------------------------------------------------------------- frontend ⇄ engine-core


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request. `request_id` is the engine-internal unique id.
    Sizes are bounded on decode (see limits.py); the engine-core checks max_model_len next.

    A continuation (failover: the request ran on an engine-core that died) carries the
    tokens it already produced in `output_token_ids`; the engine-core takes them as
    *outputs*, as after a preemption: they are computed again with the prompt, count
    towards max_tokens and min_tokens, feed the penalties and the grammar, and the next
    token is sampled at the position (and so with the random numbers) it had."""

    request_id: RequestId
    prompt_token_ids: PromptTokenIds
    sampling_params: SamplingParams
    eos_token_ids: EosTokenIds = []
    arrival_time: float = 0.0
    client_id: int = 0  # filled in by the engine-core from the sending socket
    output_token_ids: OutputTokenIds = []  # a continuation's output so far; else empty


class Abort(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Abort these engine-internal request ids (unknown or finished ids are ignored)."""

    request_ids: AbortIds


class UtilityMethod(enum.IntEnum):
    """What a client may ask of the engine-core besides requests."""

    STATS = 0  # the scheduler's `SchedulerStats`, as a dict
    RESET_PREFIX_CACHE = 1  # True if it was reset (refused while blocks are in use)
    HEALTH = 2  # True, or an error if a worker is dead
    SHUTDOWN = 3  # stop the engine-core (a daemon too)


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True):
    """Call one `UtilityMethod` on the engine-core; answered by a `UtilityResult`."""

    call_id: int
    method: UtilityMethod


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """The reply to one `UtilityCall`; `error` is set instead of `result` when it failed."""

    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreEventType(enum.IntEnum):
    """Moments in a request's life in the engine-core, for queue / prefill / decode times."""

    QUEUED = 0  # accepted by the scheduler
    SCHEDULED = 1  # taken from the waiting queue (again after each preemption)
    PREEMPTED = 2  # its KV freed; back to the waiting queue


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """One such moment, on the engine-core's clock (`time.time()`)."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What happened to one request in one step."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set with finish_reason=ERROR
    events: list[EngineCoreEvent] | None = None  # since the previous output of this request
    new_logprobs: LogprobsArrays | None = None  # one row per new token, if asked for
    # the logprobs of prompt tokens 1.. (one row each), sent once, with the first token
    new_prompt_logprobs: LogprobsArrays | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A snapshot of the scheduler after one step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, tokens found (cumulative)
    num_preemptions: int = 0  # cumulative
    step_counter: int = 0
    num_generated_tokens: int = 0  # cumulative
    # speculative decoding (cumulative): verifications (requests x steps with drafts), the
    # draft tokens they verified, those accepted, and the accepted ones by draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch of outputs sent to one client: a step's outputs, or a utility reply."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    utility_result: UtilityResult | None = None
    timestamp: float = 0.0
    engine_dead: str | None = None  # set on the last message of an engine that is dying
    # set on the last message to a client the engine-core dropped: it heard nothing from it
    # for its client timeout, and aborted its requests
    client_dropped: str | None = None


class ClientHello(msgspec.Struct, array_like=True, omit_defaults=True):
    """A client attaching: sent on the input socket (answered by `EngineCoreInfo`), then on
    the output socket to open its route there (answered by `RouteReady`)."""

    client_id: int
    protocol_version: int = PROTOCOL_VERSION
    # the client loads a tokenizer of its own: the engine-core sends no tokenizer files
    has_tokenizer: bool = False


class TokenizerFile(msgspec.Struct, array_like=True):
    """One file of the engine's tokenizer, as `save_pretrained` writes it; the client writes
    only names it knows (frontend/handshake_model.py), never a path it was sent."""

    name: TokenizerFileName
    data: TokenizerFileData


TokenizerFiles = Annotated[list[TokenizerFile], msgspec.Meta(max_length=MAX_TOKENIZER_FILES)]


class EngineCoreInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """Who the engine-core is and where to reach it: the reply to a `ClientHello`, and what
    a spawned engine-core sends its parent once it listens. `error` is set instead when it
    refuses the client (protocol version) or failed to start; the fields after it are left
    out then, so a client of an older version still reads why."""

    client_id: int = 0
    model: str = ""
    tokenizer: str = ""
    max_model_len: int = 0
    input_address: str = ""
    output_address: str = ""
    error: str | None = None
    # the engine's `ModelConfig` (limits, vocabulary, EOS ids, sampling defaults) as msgpack:
    # the frontend decodes it as that dataclass, so a client needs none of the model's files
    model_config: ModelConfigBytes = b""
    # the tokenizer, for a daemon's client that has none (`ClientHello.has_tokenizer`)
    tokenizer_files: TokenizerFiles | None = None


class RouteReady(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine-core can now send this client its outputs."""

    client_id: int


class Heartbeat(msgspec.Struct, array_like=True, omit_defaults=True):
    """A sign of life: clients send one every second, the engine-core every 0.5 s."""

    client_id: int = 0


# ---------------------------------------------------------------- engine-core ⇄ workers


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen (or are seeing again after preemption), in full."""

    req_id: str
    token_ids: list[int]  # prompt, plus the output so far when resumed after preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already cached (prefix-cache hits)
    sample_seed: int = 0  # base seed of this request's generator (derived if the user gave none)
    # with min_tokens: the ids it masks until then (the request's stop token ids, EOS
    # included whatever ignore_eos says); empty without min_tokens
    min_tokens_stop_ids: AllStopTokenIds = []


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Requests the workers already hold, as diffs, one list entry per request."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # blocks appended since the last step
    num_computed_tokens: list[int] = []  # tokens with KV before this step


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step of work for every worker rank."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}  # req_id -> tokens to run this step
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []  # finished or aborted since the last step: forget them
    # preempted by this step: forget them too (one that resumes comes back in full)
    preempted_req_ids: list[str] = []
    # requests that sample this step under a grammar: their token masks come after this
    # message, in a `GrammarBitmask` of the same step_id, one row each in this order
    structured_output_req_ids: list[str] = []
    # leading blocks held by every running request (a shared prompt prefix): the workers
    # may attend it once for all of them (cascade attention)
    num_common_prefix_blocks: int = 0
    # speculative decoding: req_id -> the draft tokens this step verifies after the
    # request's last token (its num_scheduled_tokens count them: 1 + len(drafts)); the step
    # samples 1 + len(drafts) rows for it and returns the accepted drafts and one more token
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}


class GrammarBitmask(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The allowed next tokens of one step's structured-output requests: the step's second
    call (`sample_tokens`), sent to every rank once the matchers have taken the tokens of
    every earlier step. The workers run the step's forward meanwhile and wait for this only
    to sample; a step without structured outputs is sampled without it."""

    step_id: int
    # int32 [rows, ceil(vocab_size / 32)]: bit (t % 32) of word t // 32 set means token t
    # may be sampled; one row per sampled position of each request of
    # `SchedulerOutput.structured_output_req_ids`, in that order (1 + its draft tokens:
    # row j is the mask after the first j drafts); a raw frame on the wire
    bitmask: np.ndarray


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Rank 0's answer to one `SchedulerOutput`."""

    step_id: int
    req_ids: list[str] = []
    # one list per request: the sampled ids, empty for a prefill chunk that samples nothing;
    # a verification step's are its accepted draft tokens and one more (1 to 1 + drafts)
    sampled_token_ids: list[list[int]] = []
    error: str | None = None  # the step failed; the engine turns this into a dead engine
    # logprobs of the sampled tokens of the requests that asked (SamplingParams.logprobs),
    # one row per sampled token, for the requests at logprobs_req_idx (indices into
    # req_ids), each request's rows one after another
    logprobs: LogprobsArrays | None = None
    logprobs_req_idx: list[int] = []
    # req_id -> logprobs of the prompt tokens this step's chunk predicted, in prompt order
    prompt_logprobs: dict[str, LogprobsArrays] = {}
    # speculative decoding with a draft model: per request (as req_ids; empty if none) the
    # draft tokens it proposes after this step's last sampled token
    draft_token_ids: list[list[int]] = []


class Rendezvous(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where rank 0's TCPStore listens: rank 0 → engine-core → the other ranks (TP only)."""

    host: str
    port: int


class WorkerLoaded(msgspec.Struct, array_like=True, omit_defaults=True):
    """A worker has its model loaded and this many KV blocks would fit."""

    rank: int
    pid: int
    num_gpu_blocks: int


class InitKVCache(msgspec.Struct, array_like=True, omit_defaults=True):
    """Allocate this many KV blocks (every rank gets the same, the smallest that fits)."""

    num_blocks: int


# keys of WorkerReady.startup_s that are not phases: how many Triton kernels the phases
# built, and the seconds that took within them
TRITON_KERNELS, TRITON_BUILD_S = "Triton kernels", "Triton build"


class WorkerReady(msgspec.Struct, array_like=True, omit_defaults=True):
    """A worker has its KV cache and waits for steps. `startup_s`: seconds per start-up
    phase (device, load, profile, KV cache, CUDA graphs, warm-up), then on a GPU
    TRITON_KERNELS and TRITON_BUILD_S."""

    rank: int
    pid: int
    startup_s: dict[str, float] = msgspec.field(default_factory=dict)


class ShutdownWorker(msgspec.Struct, array_like=True, omit_defaults=True):
    """Leave the step loop and exit."""
