"""Incremental detokenization and stop strings, per request.

Text is decoded one token at a time and released only once it is valid UTF-8: a byte-level
BPE token can carry half of an emoji, and '�' must not reach the user until the other half
arrives. Two decoders give the same text:

- `StreamDecoder`, for any tokenizer: the Rust `tokenizers.decoders.DecodeStream`, which keeps
  a short window of ids (~0.85 µs per token).
- `ByteLevelDecoder`, for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen): every token is a
  fixed byte string, so a table lookup and Python's incremental UTF-8 decoder replace the
  Rust call (~0.3 µs per token; `benchmarks/overhead.py` streams 256 x 512 tokens ~7% faster
  with it).

Stop strings are searched in the new text only (plus the tail that a stop string could
straddle), and that tail is held back from streamed output until it is known not to start a
stop string.
"""

from __future__ import annotations

import codecs
import weakref

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from minivllm.frontend.tokenizer import Tokenizer as HFTokenizer
from minivllm.hf_imports import from_transformers
from minivllm.protocol.messages import FinishReason
from minivllm.protocol.sampling_params import SamplingParams

# tokenizers raises this when a decode of the window does not extend the previous one,
# which some tokenizers do on invalid UTF-8; the stream is then restarted (as vLLM does).
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns one request's output ids into text, step by step, and finds its stop strings."""

    def __init__(
        self, tokenizer: HFTokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.stop = params.stop or []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # A stop string can straddle steps, so its possible first characters stay
        # unreleased until the next step (or the end) decides; included stop strings
        # never truncate released text, so nothing needs holding then.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self.num_output_tokens = 0
        # the output text in pieces, joined when read (`output_text`): appending to one
        # growing string would copy all of it every step
        self._parts: list[str] = []
        self._unreleased: list[str] = []  # the pieces at its end that no delta returned yet
        table = byte_level_table(tokenizer, params.skip_special_tokens)
        self._decoder: StreamDecoder | ByteLevelDecoder = (
            ByteLevelDecoder(table)
            if table is not None
            else StreamDecoder(tokenizer, params.skip_special_tokens, prompt_token_ids)
        )

    def update(self, new_token_ids: list[int], finish_reason: FinishReason | None) -> str | None:
        """Decode one step's new ids; return the stop string that ended the text, if any.

        `finish_reason` is the engine-core's verdict for this step. For STOP (EOS or a stop
        token id) the last id's text is left out unless `include_stop_str_in_output`. Once
        finished, bytes still waiting for the rest of their character are released as '�',
        so the final text equals `tokenizer.decode(token_ids)`.
        """
        to_decode = new_token_ids
        if finish_reason == FinishReason.STOP and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        num_before = self.num_output_tokens
        self.num_output_tokens = num_before + len(new_token_ids)
        if num_before < self.min_tokens:
            # the text of the ids before min_tokens is not searched for stop strings
            self._append(self._decoder.decode(to_decode[: self.min_tokens - num_before]))
            to_decode = to_decode[self.min_tokens - num_before :]
        new_text = self._decoder.decode(to_decode)
        if finish_reason is not None:
            new_text += self._decoder.flush()
        self._append(new_text)
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        text = self.output_text
        hit = find_stop_string(text, len(new_text), self.stop, self.include_stop_str_in_output)
        if hit is None:
            return None
        stop_str, truncate_to = hit
        # what no delta returned yet ends where the text now ends (the held-back tail always
        # covers the stop string's start, so nothing released is cut)
        num_released = len(text) - sum(len(p) for p in self._unreleased)
        self._parts[:] = [text[:truncate_to]]
        self._unreleased[:] = [text[num_released:truncate_to]]
        return stop_str

    def update_tokens(
        self, new_token_ids: list[int], finish_reason: FinishReason | None
    ) -> tuple[str | None, int]:
        """`update` for a step that may bring several tokens (speculative decoding): a stop
        string ends the text at the token that completes it, as it would have one step at a
        time. Returns the stop string (or None) and how many of the ids the text took."""
        if len(new_token_ids) == 1 or not self.stop:
            return self.update(new_token_ids, finish_reason), len(new_token_ids)
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            stop_str = self.update([token_id], finish_reason if i == last else None)
            if stop_str is not None:
                return stop_str, i + 1
        return None, len(new_token_ids)

    @property
    def output_text(self) -> str:
        parts = self._parts
        if len(parts) != 1:
            parts[:] = ["".join(parts)]
        return parts[0]

    def _append(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._unreleased.append(text)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it, or (delta) only what was not shown before.
        The stop-string tail is held back until the request finishes."""
        hold = 0 if finished else self.stop_buffer_length
        if not delta:
            text = self.output_text
            return text[:-hold] if hold else text
        unreleased = self._unreleased
        if not unreleased:
            return ""
        text = unreleased.pop() if len(unreleased) == 1 else "".join(unreleased)
        unreleased.clear()
        if hold:
            unreleased.append(text[-hold:])
            text = text[:-hold]
        return text


class StreamDecoder:
    """Any tokenizer's ids to text through `DecodeStream`; ids of an unfinished character
    stay pending until it completes (or `flush`)."""

    def __init__(
        self, tokenizer: HFTokenizer, skip_special_tokens: bool, prompt_token_ids: list[int]
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._tokenizer: Tokenizer = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # stepped, but their text is not out yet
        # Prime the stream with the end of the prompt, so that the first output token
        # decodes as it would in context (sentencepiece drops a leading space otherwise).
        self.decode(_clean_suffix(self._tokenizer, prompt_token_ids))
        self._pending.clear()

    def decode(self, token_ids: list[int]) -> str:
        text = ""
        for token_id in token_ids:
            self._pending.append(token_id)
            try:
                piece = self._stream.step(self._tokenizer, token_id)
            except Exception as e:
                piece = self._restart(token_id, e)
            if piece is not None:
                self._pending.clear()
                text += piece
        return text

    def flush(self) -> str:
        """The text of the pending ids as they are ('�' for a cut character)."""
        if not self._pending:
            return ""
        text = self._hf_tokenizer.decode(
            self._pending, skip_special_tokens=self._skip_special_tokens
        )
        self._pending.clear()
        return text

    def _restart(self, token_id: int, error: Exception) -> str | None:
        if isinstance(error, (OverflowError, TypeError)):
            return None  # an id the tokenizer cannot even represent; it decodes to nothing
        if not str(error).startswith(_INVALID_PREFIX):
            raise error
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._tokenizer, token_id)


class ByteLevelDecoder:
    """`StreamDecoder`'s text for a byte-level BPE tokenizer, from its `byte_level_table`:
    most tokens are whole characters, whose text is in the table; the others go through the
    incremental UTF-8 decoder with the bytes still pending."""

    def __init__(self, table: ByteTable) -> None:
        self._bytes, self._texts = table
        self._pending = b""  # the start of a character whose other bytes are due

    def decode(self, token_ids: list[int]) -> str:
        token_bytes, token_texts = self._bytes, self._texts
        n = len(token_bytes)
        text = ""
        for i in token_ids:
            if not 0 <= i < n:
                continue  # an id the tokenizer does not know decodes to nothing
            if not self._pending and (piece := token_texts[i]) is not None:
                text += piece
                continue
            data = self._pending + token_bytes[i]
            piece, consumed = codecs.utf_8_decode(data, "replace", False)
            self._pending = data[consumed:]
            text += piece
        return text

    def flush(self) -> str:
        """The pending bytes as they are ('�' for a cut character)."""
        text = codecs.utf_8_decode(self._pending, "replace", True)[0]
        self._pending = b""
        return text


ByteTable = tuple[list[bytes], list[str | None]]
_TABLES: weakref.WeakKeyDictionary[HFTokenizer, dict[bool, ByteTable | None]] = (
    weakref.WeakKeyDictionary()
)


def byte_level_table(tokenizer: HFTokenizer, skip_special_tokens: bool) -> ByteTable | None:
    """The bytes of every token id, and its text where those bytes are whole characters
    (else None), for a tokenizer whose decoder is `ByteLevel` alone (None for any other).
    The bytes are exactly what the Rust decoder joins and decodes, so the text of any id
    sequence is `b"".join(bytes[i] ...).decode("utf-8", "replace")`. Built once per
    tokenizer and flag, on the first request: ~1.6 µs per id (~0.25 s for 150k)."""
    tables = _TABLES.setdefault(tokenizer, {})
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = _build_byte_level_table(tokenizer, skip_special_tokens)
    return tables[skip_special_tokens]


def _build_byte_level_table(tokenizer: HFTokenizer, skip_special: bool) -> ByteTable | None:
    backend: Tokenizer = tokenizer.backend_tokenizer
    if not isinstance(backend.decoder, ByteLevel):
        return None
    # GPT-2's map from the 256 printable stand-in characters back to bytes
    bytes_to_unicode = from_transformers("convert_slow_tokenizer", "bytes_to_unicode")
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None or (skip_special and i in specials):
            table.append(b"")
        elif all(c in char_to_byte for c in token):
            table.append(bytes([char_to_byte[c] for c in token]))
        else:  # as the Rust decoder does: a token with other characters stays as it is
            table.append(token.encode())
    texts: list[str | None] = []
    for token_bytes in table:
        try:
            texts.append(token_bytes.decode())
        except UnicodeDecodeError:
            texts.append(None)
    return table, texts


def _clean_suffix(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The last few prompt ids, starting on a character boundary (no leading '�')."""
    if len(prompt_token_ids) <= 4:
        return prompt_token_ids
    for n in range(4, min(len(prompt_token_ids) + 1, 24)):
        suffix = prompt_token_ids[-n:]
        if "�" not in tokenizer.decode(suffix):
            return suffix
    return prompt_token_ids[-4:]


def find_stop_string(
    text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find the stop string that occurs first among the last `new_char_count` characters.

    Returns (stop string, length to truncate `text` to) or None. Only the new characters,
    plus the len(stop string) - 1 before them that a stop string could straddle, are
    searched: everything older was searched in earlier steps.
    """
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, (index + len(stop_str) if include_in_output else index)
