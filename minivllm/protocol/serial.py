"""Typed wire encoding: every message is a list of ZMQ frames, decoded into exactly one Struct.

Frame layout::

    frame 0      one tag byte (which Struct) + the msgpack body of that Struct
    frame 1      only if ids, logprobs or arrays were moved out: msgpack list of slot numbers
    frame 2..    the moved-out buffers: one little-endian int32 buffer per id slot, in the
                 same order, or the three logprobs buffers
    then         one raw buffer per large numpy array, in the order the body names them

With `MsgEncoder(aux_threshold=N)`, token-id lists longer than N
(`EngineCoreRequest.prompt_token_ids` and `.output_token_ids`, `NewRequestData.token_ids`)
leave the body: they are encoded there as `[]` and travel as raw int32 frames that ZMQ sends
without copying. A slot names the list a frame belongs to: slot 0 is the request's prompt,
slot 1 a continuation's output so far; slot i is `scheduled_new_reqs[i].token_ids` of a
`SchedulerOutput`.

The new tokens' logprobs of an `EngineCoreOutputs` leave the body the same way, all outputs'
rows in three frames (int32 token ids, float32 logprobs, int32 ranks), so a step's logprobs
cost three buffers rather than three per request; slot i is `outputs[i].new_logprobs`, with
one row per token of `outputs[i].new_token_ids`.

Any other numpy array (the `LogprobsArrays` fields, a `GrammarBitmask`) is `[dtype, shape, data]` in the body:
`data` is the raw little-endian bytes of a small array, or, for one of `ARRAY_FRAME_BYTES` or
more, the index of its own frame among the array frames that follow the moved-out ones. Only
the dtypes in `_ARRAY_DTYPES` decode.

Decoding only ever runs msgspec's typed decoder for the Struct class that the tag names and
the socket allows, so no bytes received are ever unpickled or turned into code.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np

from minivllm.protocol.limits import MAX_PROMPT_TOKENS
from minivllm.protocol.messages import (
    Abort,
    ClientHello,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    GrammarBitmask,
    Heartbeat,
    InitKVCache,
    LogprobsArrays,
    ModelRunnerOutput,
    Rendezvous,
    RouteReady,
    SchedulerOutput,
    ShutdownWorker,
    UtilityCall,
    WorkerLoaded,
    WorkerReady,
)

# Stable tag bytes. Letters make captured frames readable; never reuse a retired letter
# (retired with protocol 1: H, the handshake with string roles; W, the string-named worker
# commands; V, a utility result on its own, which only ever travels inside an O).
TAGS: dict[type[msgspec.Struct], bytes] = {
    EngineCoreRequest: b"R",
    Abort: b"A",
    UtilityCall: b"U",
    EngineCoreOutputs: b"O",
    ClientHello: b"C",
    EngineCoreInfo: b"I",
    RouteReady: b"D",
    Heartbeat: b"B",
    SchedulerOutput: b"S",
    ModelRunnerOutput: b"M",
    Rendezvous: b"Z",
    WorkerLoaded: b"L",
    InitKVCache: b"K",
    WorkerReady: b"Y",
    ShutdownWorker: b"X",
    GrammarBitmask: b"G",
}
_CLASS_BY_TAG: dict[int, type[msgspec.Struct]] = {tag[0]: cls for cls, tag in TAGS.items()}

# What each socket direction may carry; pass one of these to `MsgDecoder`.
FRONTEND_TO_CORE: tuple[type, ...] = (EngineCoreRequest, Abort, UtilityCall, ClientHello, Heartbeat)
CORE_TO_FRONTEND: tuple[type, ...] = (EngineCoreOutputs, EngineCoreInfo, RouteReady, Heartbeat)
CORE_TO_WORKER: tuple[type, ...] = (
    SchedulerOutput,
    GrammarBitmask,
    Rendezvous,
    InitKVCache,
    ShutdownWorker,
)
WORKER_TO_CORE: tuple[type, ...] = (ModelRunnerOutput, Rendezvous, WorkerLoaded, WorkerReady)

# Long id lists leave the msgpack body as raw int32 frames (zero-copy on the wire, and a
# receiver could keep them as arrays). Building the array from a Python list costs ~19 ns
# per id against ~3 ns inline (an IPC probe measured it; its figures are in RESULTS.md),
# which matters only for a burst of long prompts in one step: 3 ms instead of 0.6 ms for
# 256 x 512 tokens, once.
DEFAULT_AUX_THRESHOLD: int | None = 256

_INT32 = np.dtype("<i4")  # explicit byte order: tcp:// peers may differ in endianness
_Slots = Annotated[list[int], msgspec.Meta(max_length=1 << 16)]  # moved lists in one message
Frames = list[bytes | memoryview]
ARRAY_FRAME_BYTES = 4096  # smaller arrays travel inside the body
_ARRAY_DTYPES = frozenset(["<i4", "<i8", "<f4", "<f8", "|b1", "|u1"])


class ProtocolError(ValueError):
    """Frames that do not decode to an allowed message: the only error `decode` raises."""


class MsgEncoder:
    """Encodes any registered message into frames. Not thread-safe: one per sending thread."""

    def __init__(self, aux_threshold: int | None = DEFAULT_AUX_THRESHOLD) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._encode_array)
        self.aux_threshold = aux_threshold
        self._array_frames: Frames = []  # of the message being encoded

    def encode(self, msg: msgspec.Struct) -> Frames:
        """Return the frames for `msg`; `msg` itself is never modified."""
        tag = TAGS.get(type(msg))
        if tag is None:
            raise TypeError(f"{type(msg).__name__} is not a registered wire message")
        slots: list[int] = []
        aux: Frames = []
        if self.aux_threshold is not None:
            msg = self._move_out(msg, slots, aux)
        # Writing after the tag byte saves concatenating a copy of the body.
        head = bytearray(tag)
        self._array_frames = arrays = []
        try:
            self._encoder.encode_into(msg, head, 1)
        finally:
            self._array_frames = []
        if not slots and not arrays:
            return [head]
        return [head, self._encoder.encode(slots), *aux, *arrays]

    def _encode_array(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            raise NotImplementedError(f"cannot encode {type(obj).__name__}")
        arr = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<"))
        if arr.nbytes < ARRAY_FRAME_BYTES or self.aux_threshold is None:
            return (arr.dtype.str, arr.shape, arr.data)
        self._array_frames.append(arr.data)
        return (arr.dtype.str, arr.shape, len(self._array_frames) - 1)

    def _move_out(self, msg: msgspec.Struct, slots: list[int], aux: Frames) -> Any:
        limit = self.aux_threshold
        if type(msg) is EngineCoreOutputs:
            return _move_out_logprobs(msg, slots, aux)
        if type(msg) is EngineCoreRequest:
            moved = {
                name: []
                for slot, name in enumerate(_REQUEST_ID_FIELDS)
                if len(ids := getattr(msg, name)) > limit and _move_out(ids, slot, slots, aux)
            }
            return msgspec.structs.replace(msg, **moved) if moved else msg
        elif type(msg) is SchedulerOutput:
            new_reqs = msg.scheduled_new_reqs
            if any(len(r.token_ids) > limit for r in new_reqs):
                replaced = [
                    msgspec.structs.replace(req, token_ids=[])
                    if len(req.token_ids) > limit and _move_out(req.token_ids, i, slots, aux)
                    else req
                    for i, req in enumerate(new_reqs)
                ]
                return msgspec.structs.replace(msg, scheduled_new_reqs=replaced)
        return msg


class MsgDecoder:
    """Decodes frames into one of `allowed`; anything else raises `ProtocolError`.

    An id frame of more than `max_ids` ids is refused before it becomes a list (the engine-core
    passes max_model_len). Stateless after construction, so one instance may serve several
    threads.
    """

    def __init__(
        self, allowed: Sequence[type[msgspec.Struct]], max_ids: int = MAX_PROMPT_TOKENS
    ) -> None:
        unknown = [cls.__name__ for cls in allowed if cls not in TAGS]
        if unknown:
            raise TypeError(f"not registered wire messages: {unknown}")
        self.allowed = tuple(allowed)
        self.max_ids = max_ids
        self._decoders = {
            TAGS[cls][0]: msgspec.msgpack.Decoder(cls, dec_hook=self._decode_array)
            for cls in allowed
        }
        self._slot_decoder = msgspec.msgpack.Decoder(_Slots)
        self._local = threading.local()  # the array frames of the message being decoded

    def decode(self, frames: Sequence[bytes | memoryview | Any]) -> Any:
        """Decode `frames` (bytes, memoryviews or zmq.Frames) into an allowed Struct."""
        try:
            head = memoryview(frames[0])
            tag = head[0]
        except (IndexError, TypeError) as e:
            raise ProtocolError("empty message") from e
        decoder = self._decoders.get(tag)
        if decoder is None:
            cls = _CLASS_BY_TAG.get(tag)
            if cls is None:
                raise ProtocolError(f"unknown message tag {tag:#04x}")
            raise ProtocolError(f"{cls.__name__} is not allowed on this socket")
        try:
            slots = self._slot_decoder.decode(frames[1]) if len(frames) > 1 else []
            num_moved = len(_LOGPROB_DTYPES) if tag == _OUTPUTS_TAG and slots else len(slots)
            moved = frames[2 : 2 + num_moved]
            if len(moved) != num_moved:
                raise ProtocolError(f"{len(slots)} slots but {len(frames) - 2} frames")
            self._local.array_frames = frames[2 + num_moved :]
            msg = decoder.decode(head[1:])
            if tag == _OUTPUTS_TAG and slots:
                _move_in_logprobs(msg, slots, moved)
            elif slots:
                self._move_in_ids(msg, slots, moved)
        except ProtocolError:
            raise
        except Exception as e:
            # msgspec raises DecodeError/ValidationError, and __post_init__ validation
            # (SamplingParams) raises ValueError; all mean "the peer sent garbage".
            raise ProtocolError(f"bad {_CLASS_BY_TAG[tag].__name__}: {e}") from e
        finally:
            self._local.array_frames = ()
        return msg

    def _decode_array(self, cls: type, obj: Any) -> Any:
        if cls is not np.ndarray:
            raise NotImplementedError(f"cannot decode {cls.__name__}")
        try:
            dtype, shape, data = obj
            if dtype not in _ARRAY_DTYPES:
                raise ValueError(f"dtype {dtype!r} is not allowed")
            if isinstance(data, int):
                data = self._local.array_frames[data]
            return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        except Exception as e:  # any shape of garbage: a bad message, never a crash
            raise ProtocolError(f"bad array: {e}") from e

    def _move_in_ids(self, msg: Any, slots: list[int], frames: Sequence[Any]) -> None:
        if type(msg) is EngineCoreRequest:
            lists = [(msg, name) for name in _REQUEST_ID_FIELDS]
        elif type(msg) is SchedulerOutput:
            lists = [(req, "token_ids") for req in msg.scheduled_new_reqs]
        else:
            raise ProtocolError(f"{type(msg).__name__} carries no id frames")
        for slot, frame in zip(_increasing(slots, len(lists)), frames, strict=True):
            owner, field = lists[slot]
            if getattr(owner, field):
                raise ProtocolError(f"id slot {slot} is also in the body")
            buf = memoryview(frame)
            if buf.nbytes % _INT32.itemsize:
                raise ProtocolError(f"id frame of {buf.nbytes} bytes is not int32")
            if buf.nbytes // _INT32.itemsize > self.max_ids:
                raise ProtocolError(
                    f"id frame of {buf.nbytes // _INT32.itemsize} ids is over the limit of "
                    f"{self.max_ids}"
                )
            setattr(owner, field, np.frombuffer(buf, dtype=_INT32).tolist())


# the id lists of an `EngineCoreRequest`, by slot
_REQUEST_ID_FIELDS = ("prompt_token_ids", "output_token_ids")


def _move_out(ids: list[int], slot: int, slots: list[int], aux: Frames) -> bool:
    """Append `ids` as an int32 frame for `slot`; False (stay inline) if they do not fit."""
    try:
        aux.append(np.array(ids, dtype=_INT32).data)
    except (OverflowError, TypeError, ValueError):
        return False  # not int32 token ids: msgpack carries them, the peer validates them
    slots.append(slot)
    return True


_OUTPUTS_TAG = TAGS[EngineCoreOutputs][0]
_LOGPROB_DTYPES = (np.dtype("<i4"), np.dtype("<f4"), np.dtype("<i4"))  # ids, logprobs, ranks


def _move_out_logprobs(msg: EngineCoreOutputs, slots: list[int], aux: Frames) -> Any:
    """Every output's new_logprobs, concatenated into three frames."""
    outputs = list(msg.outputs)
    parts = []
    for i, out in enumerate(outputs):
        if out.new_logprobs is not None:
            slots.append(i)
            parts.append(out.new_logprobs)
            outputs[i] = msgspec.structs.replace(out, new_logprobs=None)
    if not parts:
        return msg
    packed = LogprobsArrays.concat(parts)
    arrays = (packed.token_ids, packed.logprobs, packed.ranks)
    aux.extend(
        np.ascontiguousarray(a, dtype=d).data for a, d in zip(arrays, _LOGPROB_DTYPES, strict=True)
    )
    return msgspec.structs.replace(msg, outputs=outputs)


def _move_in_logprobs(msg: EngineCoreOutputs, slots: list[int], frames: Sequence[Any]) -> None:
    """Give each output at `slots` its rows (one per new token) of the three frames."""
    owners = [msg.outputs[i] for i in _increasing(slots, len(msg.outputs))]
    num_rows = sum(len(o.new_token_ids) for o in owners)
    ids, logprobs, ranks = (
        np.frombuffer(f, dtype=d) for f, d in zip(frames, _LOGPROB_DTYPES, strict=True)
    )
    if num_rows == 0 or len(ranks) != num_rows or len(ids) != len(logprobs):
        raise ProtocolError(f"logprob frames do not hold {num_rows} rows")
    width = len(ids) // num_rows
    if width * num_rows != len(ids):
        raise ProtocolError(f"logprob frames do not hold {num_rows} rows")
    packed = LogprobsArrays(ids.reshape(-1, width), logprobs.reshape(-1, width), ranks)
    start = 0
    for out in owners:
        if out.new_logprobs is not None:
            raise ProtocolError("new_logprobs both in the body and in frames")
        stop = start + len(out.new_token_ids)
        out.new_logprobs = packed.rows(start, stop)
        start = stop


def _increasing(slots: list[int], limit: int) -> list[int]:
    """`slots`, checked strictly increasing and below `limit` (each entry filled once)."""
    last = -1
    for slot in slots:
        if not last < slot < limit:
            raise ProtocolError(f"bad slot {slot}")
        last = slot
    return slots
