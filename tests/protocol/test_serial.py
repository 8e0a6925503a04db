"""Every wire message survives a round trip; nothing else decodes, and nothing executes."""

from __future__ import annotations

import os
import pickle
import random

import msgspec
import numpy as np
import pytest

from minivllm.protocol.messages import (
    Abort,
    CachedRequestData,
    ClientHello,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarBitmask,
    Heartbeat,
    InitKVCache,
    LogprobsArrays,
    ModelRunnerOutput,
    NewRequestData,
    Rendezvous,
    RouteReady,
    SchedulerOutput,
    SchedulerStats,
    ShutdownWorker,
    TokenizerFile,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
    WorkerLoaded,
    WorkerReady,
)
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import (
    CORE_TO_FRONTEND,
    CORE_TO_WORKER,
    FRONTEND_TO_CORE,
    TAGS,
    WORKER_TO_CORE,
    MsgDecoder,
    MsgEncoder,
    ProtocolError,
)
from minivllm.protocol.structured_outputs import StructuredOutputsParams

ALL_TYPES = tuple(TAGS)
ENCODERS = {
    "inline": MsgEncoder(aux_threshold=None),
    "id-frames": MsgEncoder(),  # the default threshold
}
LONG_PROMPT = list(range(100_000, 105_000))


def _new_req(i: int, token_ids: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=f"req-{i}",
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"]),
        block_ids=list(range(i, i + len(token_ids) // 16 + 1)),
        num_computed_tokens=16,
        sample_seed=1234 + i,
        min_tokens_stop_ids=[0, 2] if i % 2 else [],
    )


def logprobs(rows: int, k: int, seed: int = 0) -> LogprobsArrays:
    rng = np.random.default_rng(seed)
    return LogprobsArrays(
        rng.integers(0, 150_000, (rows, 1 + k), dtype=np.int32),
        -rng.random((rows, 1 + k), dtype=np.float32) * 10,
        rng.integers(1, 100, rows, dtype=np.int32),
    )


def sample_messages() -> list[msgspec.Struct]:
    """One or more instances of every registered type, defaults and non-defaults."""
    sp = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, seed=7, stop_token_ids=[2])
    every = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
        logprobs=5,
        prompt_logprobs=-1,
        logit_bias={3: -1.5, 99: 100.0},
        allowed_token_ids=[3, 4, 99],
        bad_words=["a b", "c"],
        _bad_words_token_ids=[[1, 2], [3]],
        min_tokens=2,
    )
    return [
        EngineCoreRequest("r0", [1, 2, 3], every),
        EngineCoreRequest("r1", [1, 2, 3], sp, eos_token_ids=[2], arrival_time=1.5, client_id=3),
        EngineCoreRequest("r-long", LONG_PROMPT, SamplingParams()),
        EngineCoreRequest(
            "r-json",
            [1],
            SamplingParams(
                structured_outputs=StructuredOutputsParams(
                    json='{"type": "object"}', disable_any_whitespace=True
                )
            ),
        ),
        EngineCoreRequest(
            "r-choice",
            [1],
            SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])),
        ),
        Abort(["r1", "r2"]),
        UtilityCall(7, UtilityMethod.STATS),
        UtilityCall(8, UtilityMethod.SHUTDOWN),
        EngineCoreOutputs(
            outputs=[
                EngineCoreOutput("r1", [5, 6]),
                EngineCoreOutput("r2", [9], FinishReason.STOP, stop_reason=2, num_cached_tokens=16),
                EngineCoreOutput("r3", [], FinishReason.ERROR, error="bad"),
            ],
            scheduler_stats=SchedulerStats(num_running=2, kv_cache_usage=0.25, step_counter=9),
            timestamp=123.25,
        ),
        EngineCoreOutputs(
            outputs=[
                EngineCoreOutput("r1", [5], new_logprobs=logprobs(1, 5)),
                EngineCoreOutput("r2", [9]),
                EngineCoreOutput("r3", [4], FinishReason.LENGTH, new_logprobs=logprobs(1, 5, 1)),
                EngineCoreOutput("r4", [4], new_prompt_logprobs=logprobs(700, 20, 2)),
            ],
        ),
        EngineCoreOutputs(utility_result=UtilityResult(1, True)),
        EngineCoreOutputs(utility_result=UtilityResult(7, {"num_running": 3, "ratio": 0.5})),
        EngineCoreOutputs(utility_result=UtilityResult(8, error="boom")),
        EngineCoreOutputs(engine_dead="worker 0 exited with code -9"),
        ClientHello(4),
        ClientHello(5, protocol_version=1),
        EngineCoreInfo(4, "m", "m", 4096, "ipc://a", "ipc://b"),
        EngineCoreInfo(error="engine-core failed to start: boom"),
        EngineCoreInfo(
            4,
            "m",
            "m",
            4096,
            model_config=b"\x80",
            tokenizer_files=[TokenizerFile("tokenizer.json", b"{}" * 5000)],
        ),
        ClientHello(6, has_tokenizer=True),
        RouteReady(4),
        Heartbeat(4),
        Heartbeat(),
        SchedulerOutput(
            step_id=42,
            scheduled_new_reqs=[_new_req(0, [1, 2, 3]), _new_req(1, LONG_PROMPT), _new_req(2, [])],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=["a", "b"], new_block_ids=[[7], []], num_computed_tokens=[100, 31]
            ),
            num_scheduled_tokens={"req-0": 3, "req-1": 512, "a": 1, "b": 1},
            total_num_scheduled_tokens=517,
            finished_req_ids=["z"],
            preempted_req_ids=["y"],
            structured_output_req_ids=["a"],
        ),
        SchedulerOutput(step_id=0),
        GrammarBitmask(42, np.full((1, 4748), -1, dtype=np.int32)),
        GrammarBitmask(43, np.arange(6, dtype=np.int32).reshape(2, 3)),
        ModelRunnerOutput(3, ["a", "b"], [[11], []]),
        ModelRunnerOutput(
            5,
            ["a", "b", "c"],
            [[11], [12], []],
            logprobs=logprobs(2, 3),
            logprobs_req_idx=[0, 1],
            prompt_logprobs={"c": logprobs(300, 2, 3), "d": logprobs(1, 0, 4)},
        ),
        ModelRunnerOutput(4, error="CUDA error: out of memory"),
        Rendezvous("127.0.0.1", 29500),
        WorkerLoaded(1, os.getpid(), 1000),
        InitKVCache(1000),
        WorkerReady(1, os.getpid()),
        ShutdownWorker(),
    ]


@pytest.mark.parametrize("encoder", ENCODERS.values(), ids=ENCODERS.keys())
@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: msgspec.Struct, encoder: MsgEncoder) -> None:
    frames = encoder.encode(msg)
    decoded = MsgDecoder(ALL_TYPES).decode([bytes(f) for f in frames])
    assert type(decoded) is type(msg)
    assert as_builtins(decoded) == as_builtins(msg)


def as_builtins(msg: msgspec.Struct) -> object:
    """The message as plain Python values (numpy arrays as lists: == on arrays is elementwise)."""
    return msgspec.to_builtins(
        msg, enc_hook=lambda a: (a.dtype.str, a.tolist()) if isinstance(a, np.ndarray) else a
    )


def test_logprobs_travel_as_array_frames() -> None:
    """A step's sampled-token logprobs go as three frames for the whole message, whatever the
    number of requests; large arrays (prompt logprobs) as frames of their own; nothing of them
    is a Python object per token in the body."""
    outs = EngineCoreOutputs(
        [EngineCoreOutput(str(i), [i], new_logprobs=logprobs(1, 5, i)) for i in range(256)]
    )
    frames = ENCODERS["id-frames"].encode(outs)
    assert len(frames) == 2 + 3
    assert memoryview(frames[3]).nbytes == 256 * 6 * 4  # float32 logprobs
    decoded = MsgDecoder(CORE_TO_FRONTEND).decode(frames)
    for sent, got in zip(outs.outputs, decoded.outputs, strict=True):
        assert np.array_equal(sent.new_logprobs.logprobs, got.new_logprobs.logprobs)
        assert np.array_equal(sent.new_logprobs.token_ids, got.new_logprobs.token_ids)
        assert got.new_logprobs.ranks.tolist() == sent.new_logprobs.ranks.tolist()
    assert outs.outputs[0].new_logprobs is not None  # the caller's message is intact
    # rows of different widths share the frames: each keeps its own columns
    mixed = EngineCoreOutputs(
        [EngineCoreOutput(str(k), [1], new_logprobs=logprobs(1, k)) for k in (0, 3)]
    )
    narrow, wide = MsgDecoder(CORE_TO_FRONTEND).decode(ENCODERS["id-frames"].encode(mixed)).outputs
    assert (
        narrow.new_logprobs.token_ids[0, :1].tolist()
        == mixed.outputs[0].new_logprobs.token_ids[0].tolist()
    )
    assert wide.new_logprobs.logprobs.tolist() == mixed.outputs[1].new_logprobs.logprobs.tolist()
    prompt = ModelRunnerOutput(1, ["a"], [[1]], prompt_logprobs={"a": logprobs(2000, 20)})
    frames = ENCODERS["id-frames"].encode(prompt)
    assert len(frames) == 2 + 3 and len(frames[0]) < 200


def test_every_type_round_trips() -> None:
    assert {type(m) for m in sample_messages()} == set(ALL_TYPES)


def test_long_token_ids_travel_as_extra_frames() -> None:
    msg = next(m for m in sample_messages() if isinstance(m, SchedulerOutput))
    frames = ENCODERS["id-frames"].encode(msg)
    # head, slot table, one int32 frame for the 5,000-token prompt only
    assert len(frames) == 3
    assert memoryview(frames[2]).nbytes == 4 * len(LONG_PROMPT)
    assert len(frames[0]) < 1000
    assert msg.scheduled_new_reqs[1].token_ids == LONG_PROMPT  # the caller's copy is intact
    assert MsgDecoder(CORE_TO_WORKER).decode(frames) == msg

    assert len(MsgEncoder().encode(msg)) == 3  # the default
    inline = ENCODERS["inline"].encode(msg)
    assert len(inline) == 1
    assert MsgDecoder(CORE_TO_WORKER).decode(inline) == msg


def test_ids_outside_int32_stay_inline() -> None:
    msg = EngineCoreRequest("r", [2**40] * 300, SamplingParams())
    frames = ENCODERS["id-frames"].encode(msg)
    assert len(frames) == 1
    assert MsgDecoder(FRONTEND_TO_CORE).decode(frames) == msg


@pytest.mark.parametrize(
    ("allowed", "msg"),
    [
        (FRONTEND_TO_CORE, EngineCoreOutputs()),
        (CORE_TO_FRONTEND, EngineCoreRequest("r", [1], SamplingParams())),
        (CORE_TO_WORKER, ModelRunnerOutput(1)),
        (WORKER_TO_CORE, SchedulerOutput(1)),
        (WORKER_TO_CORE, ShutdownWorker()),
        (CORE_TO_WORKER, WorkerLoaded(0, 1, 2)),
        (FRONTEND_TO_CORE, EngineCoreInfo()),
        (CORE_TO_FRONTEND, ClientHello(1)),
    ],
)
def test_type_not_allowed_on_socket(allowed: tuple[type, ...], msg: msgspec.Struct) -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        MsgDecoder(allowed).decode(MsgEncoder().encode(msg))


class _WritesMarker:
    """Unpickling this would create the marker file: proof that something executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_payload_never_executes(tmp_path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_WritesMarker(str(marker)), protocol=protocol)
    attempts = [[payload]]
    # also behind every valid tag, and as an id frame after a valid head
    attempts += [[tag + payload] for tag in TAGS.values()]
    head = ENCODERS["id-frames"].encode(EngineCoreRequest("r", LONG_PROMPT, SamplingParams()))
    attempts += [[head[0], payload, payload]]
    decoders = [MsgDecoder(a) for a in (FRONTEND_TO_CORE, CORE_TO_FRONTEND, CORE_TO_WORKER)]
    decoders += [MsgDecoder(WORKER_TO_CORE), MsgDecoder(ALL_TYPES)]
    for decoder in decoders:
        for frames in attempts:
            with pytest.raises(ProtocolError):
                decoder.decode(frames)
        # as an id frame the bytes are read as int32 ids (when their length allows): data,
        # never code
        try:
            msg = decoder.decode([head[0], head[1], payload])
        except ProtocolError:
            continue
        assert all(type(t) is int for t in msg.prompt_token_ids)
    assert not marker.exists()


def _mutations(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One random corruption: flipped bytes, truncation, extension, dropped or extra frames."""
    frames = list(frames)
    i = rng.randrange(len(frames))
    f = bytearray(frames[i])
    kind = rng.randrange(5)
    if kind == 0 and len(f) > 1:
        for _ in range(rng.randint(1, 4)):
            f[rng.randrange(1, len(f))] = rng.randrange(256)
    elif kind == 1:
        f = f[: rng.randrange(len(f) + 1)]
    elif kind == 2:
        f += rng.randbytes(rng.randint(1, 8))
    elif kind == 3 and len(frames) > 1:
        del frames[rng.randrange(1, len(frames))]
        return frames
    else:
        frames.append(rng.randbytes(rng.randint(0, 16)))
    frames[i] = bytes(f)
    return frames


def test_garbage_only_ever_raises_protocol_error() -> None:
    rng = random.Random(1234)
    decoder = MsgDecoder(ALL_TYPES)
    encoded = [
        [bytes(f) for f in encoder.encode(m)]
        for encoder in ENCODERS.values()
        for m in sample_messages()
    ]
    for case in range(1500):
        if case % 3 == 0:  # pure noise, often behind a valid tag
            tag = rng.choice([*TAGS.values(), b""])
            frames = [tag + rng.randbytes(rng.randint(0, 64))]
            frames += [rng.randbytes(rng.randint(0, 8)) for _ in range(rng.randrange(3))]
        else:
            frames = _mutations(rng, rng.choice(encoded))
        try:
            msg = decoder.decode(frames)
        except ProtocolError:
            continue
        # A corruption may still be a valid message: then it is of a registered type.
        assert type(msg) in TAGS


def test_empty_and_unknown() -> None:
    decoder = MsgDecoder(ALL_TYPES)
    for frames in ([], [b""], [b"\x00"], [b"Q\x90"], [memoryview(b"")]):
        with pytest.raises(ProtocolError):
            decoder.decode(frames)


def test_missing_id_frame() -> None:
    frames = ENCODERS["id-frames"].encode(EngineCoreRequest("r", LONG_PROMPT, SamplingParams()))
    with pytest.raises(ProtocolError, match="slots"):
        MsgDecoder(FRONTEND_TO_CORE).decode(frames[:2])


def test_unregistered_type_is_refused() -> None:
    with pytest.raises(TypeError):
        MsgEncoder().encode(SamplingParams())
    with pytest.raises(TypeError):
        MsgDecoder((SamplingParams,))


def test_utility_methods_outside_the_enum_do_not_decode() -> None:
    head = bytes(MsgEncoder().encode(UtilityCall(1, UtilityMethod.STATS))[0])
    assert head[0:1] == TAGS[UtilityCall]
    unknown = head[:1] + msgspec.msgpack.encode([1, 99])
    with pytest.raises(ProtocolError, match="UtilityCall"):
        MsgDecoder(FRONTEND_TO_CORE).decode([unknown])
    by_name = head[:1] + msgspec.msgpack.encode([1, "__import__"])
    with pytest.raises(ProtocolError, match="UtilityCall"):
        MsgDecoder(FRONTEND_TO_CORE).decode([by_name])
