"""Hypothesis strategies for what a peer might send instead of a message: random bytes,
valid tags with wrong bodies, truncated, mutated and oversized encodings, raw pickles and
unknown types. Shared by the decoder property tests, the live-socket tests and the long
fuzz run in benchmarks/."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from minivllm.protocol import limits
from minivllm.protocol.messages import Abort, EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import TAGS, MsgDecoder, MsgEncoder, ProtocolError
from tests.protocol.test_serial import sample_messages

Frames = list[bytes]

# a few hundred inputs per live socket keeps CI's share short; benchmarks/ runs 100k
LIVE_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
KNOWN_TAGS = sorted(TAGS.values())
UNKNOWN_TAGS = [bytes([b]) for b in range(256) if bytes([b]) not in TAGS.values()]
# every registered message, encoded with its ids inline and as id frames
VALID: list[Frames] = [
    [bytes(f) for f in encoder.encode(msg)]
    for encoder in (MsgEncoder(aux_threshold=None), MsgEncoder(aux_threshold=4))
    for msg in sample_messages()
]


class WritesMarker:
    """Unpickling this creates the marker file: proof that something was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def _oversized(max_ids: int) -> list[Frames]:
    """Messages over one of their bounds, each small enough to pass any socket's limit."""
    params = msgspec.msgpack.encode(SamplingParams())
    request = MsgEncoder(aux_threshold=0).encode(EngineCoreRequest("r", [1], SamplingParams()))
    head, slots = bytes(request[0]), bytes(request[1])
    too_many_ids = np.zeros(max_ids + 1, dtype="<i4").tobytes()

    def request_with(**fields) -> bytes:
        body = ["r", [1, 2, 3], msgspec.msgpack.decode(params), []]
        for i, name in enumerate(("request_id", "prompt_token_ids", "sampling_params", "eos")):
            body[i] = fields.get(name, body[i])
        return TAGS[EngineCoreRequest] + msgspec.msgpack.encode(body)

    too_many_stops = [
        1,
        1.0,
        1.0,
        0,
        0.0,
        None,
        16,
        0,
        False,
        ["x"] * (limits.MAX_STOP_STRINGS + 1),
    ]
    return [
        [head, slots, too_many_ids],  # an id frame over max_ids
        [head, slots, b"\x01\x02\x03"],  # an id frame that is not int32
        [head, msgspec.msgpack.encode([0, 0]), b"", b""],  # two slots for one list
        [head, msgspec.msgpack.encode([2]), b""],  # a slot past the request's two lists
        [request_with(eos=[0] * (limits.MAX_EOS_TOKEN_IDS + 1))],
        [request_with(sampling_params=too_many_stops)],
        [request_with(sampling_params=[limits.MAX_N + 1])],
        [request_with(request_id="r" * (limits.MAX_REQUEST_ID_CHARS + 1))],
        [TAGS[Abort] + msgspec.msgpack.encode([["r"] * (limits.MAX_ABORT_IDS + 1)])],
    ]


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
msgpack_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=4) | st.integers(-8, 8), inner, max_size=4)
    ),
    max_leaves=24,
)


@st.composite
def _truncated(draw) -> Frames:
    frames = list(draw(st.sampled_from(VALID)))
    i = draw(st.integers(0, len(frames) - 1))
    frames[i] = frames[i][: draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
    if draw(st.booleans()):
        frames = frames[: draw(st.integers(1, len(frames)))]
    return frames


@st.composite
def _mutated(draw) -> Frames:
    frames = list(draw(st.sampled_from(VALID)))
    i = draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[i])
    for _ in range(draw(st.integers(1, 4))):
        if frame:
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    frames[i] = bytes(frame)
    if draw(st.booleans()):  # and, sometimes, frames no message has
        frames += draw(st.lists(st.binary(max_size=16), min_size=1, max_size=3))
    return frames


def garbage(marker_path: str, max_ids: int = limits.MAX_PROMPT_TOKENS) -> st.SearchStrategy:
    """Frames a decoder must refuse (or, rarely, that happen to be a valid message)."""
    pickles = [
        pickle.dumps(obj, protocol=p)
        for obj in (WritesMarker(marker_path), {"a": [1, 2]}, SamplingParams)
        for p in range(pickle.HIGHEST_PROTOCOL + 1)
    ]
    tags = st.sampled_from(KNOWN_TAGS)
    return st.one_of(
        st.lists(st.binary(max_size=300), min_size=1, max_size=4),  # random bytes
        st.tuples(tags, st.binary(max_size=200)).map(lambda t: [t[0] + t[1]]),
        st.tuples(tags, msgpack_values).map(lambda t: [t[0] + msgspec.msgpack.encode(t[1])]),
        _truncated(),
        _mutated(),
        st.tuples(st.sampled_from([b"", *KNOWN_TAGS]), st.sampled_from(pickles)).map(
            lambda t: [t[0] + t[1]]  # raw pickle, bare or behind a valid tag
        ),
        st.tuples(st.sampled_from(UNKNOWN_TAGS), st.binary(max_size=100)).map(
            lambda t: [t[0] + t[1]]
        ),
        st.sampled_from(_oversized(max_ids)),
    )


def refuses(decoder: MsgDecoder, frames: Frames) -> bool:
    """True if `decoder` drops `frames`; anything but a ProtocolError propagates."""
    try:
        decoder.decode(frames)
    except ProtocolError:
        return True
    return False
