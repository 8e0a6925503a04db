"""Every message bounds its own sizes: the user hears which parameter is too big, and a peer
that sends too much is refused before the receiver allocates for it."""

from __future__ import annotations

import time
import tracemalloc

import msgspec
import numpy as np
import pytest
import zmq

from minivllm.protocol import limits
from minivllm.protocol.messages import Abort, EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import FRONTEND_TO_CORE, TAGS, MsgDecoder, MsgEncoder, ProtocolError
from minivllm.protocol.structured_outputs import StructuredOutputsParams
from minivllm.protocol.transport import (
    bind_socket,
    connect_socket,
    recv_msg,
    send_msg,
    tcp_address,
)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"n": limits.MAX_N + 1}, "n"),
        ({"stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (limits.MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"logit_bias": dict.fromkeys(range(limits.MAX_LOGIT_BIAS + 1), 1.0)}, "logit_bias"),
        ({"allowed_token_ids": [1] * (limits.MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids"),
        ({"bad_words": [f"w{i}" for i in range(limits.MAX_BAD_WORDS + 1)]}, "bad_words"),
        ({"bad_words": ["x" * (limits.MAX_STOP_STRING_CHARS + 1)]}, "bad_words"),
    ],
)
def test_user_hears_which_parameter_is_too_big(kwargs: dict, parameter: str) -> None:
    with pytest.raises(ValueError, match=rf"^{parameter}\b"):
        SamplingParams(**kwargs)
    SamplingParams(**{k: _one_less(v) for k, v in kwargs.items()})  # the limit itself is fine


def test_structured_output_sizes() -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs.regex: at most"):
        StructuredOutputsParams(regex="a" * (limits.MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match=r"^structured_outputs.choice: at most"):
        StructuredOutputsParams(choice=["a"] * (limits.MAX_CHOICES + 1))
    big = {"type": "object", "description": "x" * limits.MAX_GRAMMAR_CHARS}
    with pytest.raises(ValueError, match=r"^structured_outputs.json: at most"):
        StructuredOutputsParams(json=big)
    StructuredOutputsParams(regex="a" * limits.MAX_GRAMMAR_CHARS)


def _one_less(value):
    if isinstance(value, dict):
        return dict(list(value.items())[:-1])
    if isinstance(value, list) and len(value) == 1:
        return [value[0][:-1]]
    return value[:-1] if isinstance(value, list) else value - 1


def _request_body(**fields) -> bytes:
    """An EngineCoreRequest head built field by field, so it may break the limits."""
    body = ["r", [1, 2, 3], [], [], 0.0, 0]
    names = ["request_id", "prompt_token_ids", "sampling_params", "eos_token_ids"]
    for name, value in fields.items():
        body[names.index(name)] = value
    return TAGS[EngineCoreRequest] + msgspec.msgpack.encode(body)


def _peak_decode_bytes(decoder: MsgDecoder, frames: list) -> int:
    """Peak Python allocation while `frames` fail to decode."""
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decoder.decode(frames)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_token_ids": [1] * (limits.MAX_PROMPT_TOKENS + 1)},
        {"request_id": "r" * (1 << 24)},
        {"eos_token_ids": [0] * (1 << 22)},
        {"sampling_params": [1, 1.0, 1.0, 0, 0.0, None, 16, 0, False, ["s"] * (1 << 22)]},
        {"sampling_params": [1, 1.0, 1.0, 0, 0.0, None, 16, 0, False, None, [5] * (1 << 22)]},
    ],
    ids=["prompt", "request_id", "eos_token_ids", "stop", "stop_token_ids"],
)
def test_oversized_fields_are_refused_before_allocating(fields: dict) -> None:
    frame = _request_body(**fields)
    assert len(frame) > 4 << 20
    peak = _peak_decode_bytes(MsgDecoder(FRONTEND_TO_CORE), [frame])
    # a list is refused from its header; a string's characters are counted once it is
    # decoded, so it may cost its own bytes once (the socket's frame limit bounds those)
    allowance = len(frame) if "request_id" in fields else 0
    assert peak < allowance + (64 << 10), f"{peak} bytes allocated for a refused message"


def test_id_frame_over_max_ids_is_refused_before_it_becomes_a_list() -> None:
    request = EngineCoreRequest("r", list(range(4000)), SamplingParams())
    frames = [bytes(f) for f in MsgEncoder().encode(request)]
    assert len(frames) == 3  # the prompt travels as an int32 frame
    assert MsgDecoder(FRONTEND_TO_CORE, max_ids=4000).decode(frames) == request
    with pytest.raises(ProtocolError, match="over the limit of 3999"):
        MsgDecoder(FRONTEND_TO_CORE, max_ids=3999).decode(frames)
    huge = [frames[0], frames[1], np.zeros(1 << 22, dtype="<i4").tobytes()]
    peak = _peak_decode_bytes(MsgDecoder(FRONTEND_TO_CORE, max_ids=4096), huge)
    assert peak < 64 << 10


def test_too_many_ids_in_one_abort() -> None:
    body = TAGS[Abort] + msgspec.msgpack.encode([["r"] * (limits.MAX_ABORT_IDS + 1)])
    with pytest.raises(ProtocolError, match="Abort"):
        MsgDecoder(FRONTEND_TO_CORE).decode([body])


def test_a_frame_over_the_socket_limit_never_arrives() -> None:
    ctx = zmq.Context()
    pull, address = bind_socket(ctx, zmq.PULL, tcp_address(), max_message_bytes=1 << 20)
    big = connect_socket(ctx, zmq.PUSH, address)
    small = connect_socket(ctx, zmq.PUSH, address)
    try:
        send_msg(big, [b"x" * ((1 << 20) + 1)])
        time.sleep(0.5)
        send_msg(small, [b"y" * (1 << 20)])  # the limit itself passes, on its own connection
        frames = recv_msg(pull, timeout_ms=5000)
        assert frames is not None and bytes(frames[0][:1]) == b"y"
        assert recv_msg(pull, timeout_ms=500) is None
    finally:
        for sock in (big, small, pull):
            sock.close(linger=0)
        ctx.term()


def test_handshake_tokenizer_files_are_bounded() -> None:
    """A daemon's handshake carries at most MAX_TOKENIZER_FILES files; a client refuses more
    (and any one file over the whole limit) without building them."""
    from minivllm.protocol.messages import EngineCoreInfo, TokenizerFile
    from minivllm.protocol.serial import CORE_TO_FRONTEND

    many = [TokenizerFile(f"f{i}", b"x") for i in range(limits.MAX_TOKENIZER_FILES + 1)]
    frames = MsgEncoder().encode(EngineCoreInfo(1, tokenizer_files=many))
    with pytest.raises(ProtocolError, match="length"):
        MsgDecoder(CORE_TO_FRONTEND).decode(frames)
    fits = [TokenizerFile("tokenizer.json", b"x" * 1000)]
    info = MsgDecoder(CORE_TO_FRONTEND).decode(
        MsgEncoder().encode(EngineCoreInfo(1, tokenizer_files=fits))
    )
    assert info.tokenizer_files == fits
