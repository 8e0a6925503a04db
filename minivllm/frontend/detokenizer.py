"""Incremental detokenization and stop strings, per request.

Text is decoded one token at a time with the Rust `tokenizers.decoders.DecodeStream`, which
keeps a short window of ids and yields new text only once it is valid UTF-8: a byte-level
BPE token can carry half of an emoji, and '�' must not reach the user until the other half
arrives. Stop strings are searched in the new text only (plus the tail that a stop string
could straddle), and that tail is held back from streamed output until it is known not to
start a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from minivllm.frontend.tokenizer import Tokenizer as HFTokenizer
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
        self._hf_tokenizer = tokenizer
        self._tokenizer: Tokenizer = tokenizer.backend_tokenizer
        self.skip_special_tokens = params.skip_special_tokens
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
        self.output_text = ""
        self.num_output_tokens = 0
        self._pending_ids: list[int] = []  # stepped, but their text is not out yet
        self._last_output_text_offset = 0
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        # Prime the stream with the end of the prompt, so that the first output token
        # decodes as it would in context (sentencepiece drops a leading space otherwise).
        self._decode(_clean_suffix(self._tokenizer, prompt_token_ids))
        self._pending_ids.clear()

    def update(self, new_token_ids: list[int], finish_reason: FinishReason | None) -> str | None:
        """Decode one step's new ids; return the stop string that ended the text, if any.

        `finish_reason` is the engine-core's verdict for this step. For STOP (EOS or a stop
        token id) the last id's text is left out unless `include_stop_str_in_output`. Once
        finished, bytes still waiting for the rest of their character are released as '�',
        so the final text equals `tokenizer.decode(token_ids)`.
        """
        to_decode = new_token_ids
        if finish_reason is not None:
            if finish_reason == FinishReason.STOP and not self.include_stop_str_in_output:
                to_decode = new_token_ids[:-1]
        num_before = self.num_output_tokens
        self.num_output_tokens = num_before + len(new_token_ids)
        if not self.stop:
            self.output_text += self._decode(to_decode)
            self._flush_pending(finish_reason)
            return None
        # stop strings count only after min_tokens: the text of the ids before it is not
        # searched
        num_unchecked = min(max(self.min_tokens - num_before, 0), len(to_decode))
        if num_unchecked:
            self.output_text += self._decode(to_decode[:num_unchecked])
            to_decode = to_decode[num_unchecked:]
        stop_check_offset = len(self.output_text)
        self.output_text += self._decode(to_decode)
        self._flush_pending(finish_reason)
        if self.num_output_tokens <= self.min_tokens:
            return None
        hit = find_stop_string(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if hit is None:
            return None
        stop_str, truncate_to = hit
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it, or (delta) only what was not shown before.
        The stop-string tail is held back until the request finishes."""
        hold = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - hold, 0)
        if not delta:
            return self.output_text[:end] if hold else self.output_text
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]

    def _decode(self, token_ids: list[int]) -> str:
        """The text that `token_ids` complete; ids of an unfinished character stay pending."""
        text = ""
        stream, tokenizer, pending = self._stream, self._tokenizer, self._pending_ids
        for token_id in token_ids:
            pending.append(token_id)
            try:
                piece = stream.step(tokenizer, token_id)
            except Exception as e:
                piece = self._restart_stream(token_id, e)
                stream = self._stream
            if piece is not None:
                pending.clear()
                text += piece
        return text

    def _flush_pending(self, finish_reason: FinishReason | None) -> None:
        if finish_reason is not None and self._pending_ids:
            self.output_text += self._hf_tokenizer.decode(
                self._pending_ids, skip_special_tokens=self.skip_special_tokens
            )
            self._pending_ids.clear()

    def _restart_stream(self, token_id: int, error: Exception) -> str | None:
        if isinstance(error, (OverflowError, TypeError)):
            return None  # an id the tokenizer cannot even represent; it decodes to nothing
        if not str(error).startswith(_INVALID_PREFIX):
            raise error
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return self._stream.step(self._tokenizer, token_id)


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
