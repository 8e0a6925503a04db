"""How much one message may carry: the same bounds for the peer that decodes and the user
who builds it.

A receiver enforces them before it allocates for a message: ZMQ refuses a frame over its
socket's `zmq.MAXMSGSIZE` from the size header and closes that connection, msgspec checks a
list's or string's length from its header (the `Annotated` fields of the wire types), and
`MsgDecoder` checks an id frame's length before it turns the frame into a list. The frontend
checks the same numbers first and raises a `ValueError` naming the parameter, so a well-formed
client never sends what a receiver drops.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# Any one frame on an engine-internal socket (engine-core ⇄ workers, outputs to clients).
MAX_MESSAGE_BYTES = 64 << 20
# Any one frame a client sends the engine-core: a request's prompt travels as an int32 frame
# of at most max_model_len ids; everything else of one request fits well within this.
MAX_REQUEST_BODY_BYTES = 4 << 20
# Any one frame on a socket that only carries start-up talk (a client's route registration).
MAX_CONTROL_BYTES = 64 << 10

MAX_REQUEST_ID_CHARS = 512  # an engine-internal id: the user's id plus a unique suffix
MAX_USER_REQUEST_ID_CHARS = 256  # what a user may pass as request_id
MAX_PROMPT_TOKENS = 1 << 22  # on the wire; the engine-core then checks max_model_len
MAX_EOS_TOKEN_IDS = 64
MAX_N = 128  # completions per request (OpenAI's limit)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_ABORT_IDS = 1 << 16  # request ids in one Abort; a client sends more as several
MAX_LOGIT_BIAS = 1 << 16  # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # a vocabulary's worth (the largest are ~256k)
MAX_BAD_WORDS = 1024  # each at most MAX_STOP_STRING_CHARS characters
MAX_GRAMMAR_CHARS = 1 << 20  # a structured output's JSON schema, regex or grammar
MAX_CHOICES = 4096  # structured_outputs.choice entries, each at most MAX_CHOICE_CHARS
MAX_CHOICE_CHARS = 4096
# what a daemon's handshake may carry: the engine's model config, and its tokenizer's files
# (a vocabulary of 256k tokens takes ~35 MB); all of it within one MAX_MESSAGE_BYTES frame
MAX_MODEL_CONFIG_BYTES = 8 << 20
MAX_TOKENIZER_BYTES = 48 << 20  # the files together
MAX_TOKENIZER_FILES = 32
MAX_TOKENIZER_FILE_NAME_CHARS = 255


def request_frame_bytes(max_model_len: int) -> int:
    """`zmq.MAXMSGSIZE` of the engine-core's input socket: a prompt of `max_model_len`
    int32 ids in its own frame, or any other part of a request."""
    return MAX_REQUEST_BODY_BYTES + 4 * max_model_len


def _bounded(kind: Any, max_length: int) -> Any:
    """`kind` (a str, list or dict) whose length msgspec checks on decode."""
    return Annotated[kind, msgspec.Meta(max_length=max_length)]


# Field types that carry their bound, for the wire types.
RequestId = _bounded(str, MAX_REQUEST_ID_CHARS)
PromptTokenIds = _bounded(list[int], MAX_PROMPT_TOKENS)
# a continuation's output so far: with its prompt, within max_model_len (the engine-core checks)
OutputTokenIds = _bounded(list[int], MAX_PROMPT_TOKENS)
EosTokenIds = _bounded(list[int], MAX_EOS_TOKEN_IDS)
AbortIds = _bounded(list[RequestId], MAX_ABORT_IDS)
_StopString = _bounded(str, MAX_STOP_STRING_CHARS)
StopStrings = _bounded(list[_StopString], MAX_STOP_STRINGS)
StopTokenIds = _bounded(list[int], MAX_STOP_TOKEN_IDS)
LogitBias = _bounded(dict[int, float], MAX_LOGIT_BIAS)
AllowedTokenIds = _bounded(list[int], MAX_ALLOWED_TOKEN_IDS)
BadWords = _bounded(list[_StopString], MAX_BAD_WORDS)
# the frontend's tokenization of bad_words: one or two sequences per word
BadWordsTokenIds = _bounded(list[_bounded(list[int], MAX_STOP_STRING_CHARS)], 2 * MAX_BAD_WORDS)
GrammarText = _bounded(str, MAX_GRAMMAR_CHARS)
Choices = _bounded(list[_bounded(str, MAX_CHOICE_CHARS)], MAX_CHOICES)
AllStopTokenIds = _bounded(list[int], MAX_STOP_TOKEN_IDS + MAX_EOS_TOKEN_IDS)
ModelConfigBytes = _bounded(bytes, MAX_MODEL_CONFIG_BYTES)
TokenizerFileName = _bounded(str, MAX_TOKENIZER_FILE_NAME_CHARS)
TokenizerFileData = _bounded(bytes, MAX_TOKENIZER_BYTES)
