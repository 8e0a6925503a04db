"""Property tests over every decoder of protocol/: whatever the frames, a decoder returns a
message its socket allows or raises ProtocolError, and never executes anything."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from minivllm.protocol.messages import ClientHello
from minivllm.protocol.serial import (
    CORE_TO_FRONTEND,
    CORE_TO_WORKER,
    FRONTEND_TO_CORE,
    WORKER_TO_CORE,
    MsgDecoder,
    MsgEncoder,
)
from tests.protocol.frame_strategies import garbage, refuses

# what each socket of the engine decodes (the engine-core's output socket: route hellos)
DIRECTIONS = {
    "frontend-to-core": FRONTEND_TO_CORE,
    "core-routes": (ClientHello,),
    "core-to-frontend": CORE_TO_FRONTEND,
    "core-to-worker": CORE_TO_WORKER,
    "worker-to-core": WORKER_TO_CORE,
}
MARKER = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minivllm-fuzz-marker-{os.getpid()}")
MAX_IDS = 4096  # the engine-core passes max_model_len; an id frame longer is oversized


@pytest.mark.parametrize("allowed", DIRECTIONS.values(), ids=DIRECTIONS.keys())
def test_decoder_refuses_garbage(allowed: tuple[type, ...]) -> None:
    decoder = MsgDecoder(allowed, max_ids=MAX_IDS)
    seen = {"refused": 0, "decoded": 0}

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(frames=garbage(MARKER, max_ids=MAX_IDS))
    def decode(frames: list[bytes]) -> None:
        if refuses(decoder, frames):
            seen["refused"] += 1
            return
        # a corruption may still be a valid message: then of a type this socket allows,
        # and it encodes back (nothing half-built got through)
        msg = decoder.decode(frames)
        assert type(msg) in allowed
        MsgEncoder().encode(msg)
        seen["decoded"] += 1

    decode()
    assert not os.path.exists(MARKER), "a pickle was executed"
    assert seen["refused"] > 10 * seen["decoded"]
