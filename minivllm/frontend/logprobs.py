"""One request's logprobs in the frontend: kept as the arrays that arrived, and turned into
vLLM's `{token_id: Logprob}` dicts only when an output is made (for `LLM.generate`, once, at
the end), with each token's text as vLLM gives it."""

from __future__ import annotations

import json
import os

from minivllm.frontend.tokenizer import Tokenizer
from minivllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from minivllm.protocol.messages import LogprobsArrays

_REPLACEMENT = "\ufffd"  # what a token that ends inside a UTF-8 character decodes to


class RequestLogprobs:
    """The sampled tokens' logprobs (`logprobs`, when asked for) and the prompt's
    (`prompt_logprobs`), each row holding the token itself first and then the top-k."""

    def __init__(
        self, num_logprobs: int | None, num_prompt_logprobs: int | None, texts: TokenTexts | None
    ) -> None:
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.texts = texts
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self._sample: SampleLogprobs = []
        self._pending: list[LogprobsArrays] = []  # arrived, not turned into dicts yet
        self._prompt: PromptLogprobs | None = None
        self._prompt_taken = False

    def add(self, new: LogprobsArrays | None, prompt: LogprobsArrays | None) -> None:
        if new is not None and self.num_logprobs is not None:
            self._pending.append(new)
            for value in new.logprobs[:, 0].tolist():
                self.cumulative_logprob += value
        if prompt is not None and self.num_prompt_logprobs is not None:
            self._prompt = [None]  # the first prompt token has nothing before it
            self._append(self._prompt, prompt, self.num_prompt_logprobs)

    def sample_logprobs(self, last: int | None = None) -> SampleLogprobs | None:
        """Every position so far (a copy), or only the `last` ones (DELTA)."""
        if self.num_logprobs is None:
            return None
        if self._pending:  # all steps' rows at once: one conversion to lists, not one per step
            self._append(self._sample, LogprobsArrays.concat(self._pending), self.num_logprobs)
            self._pending.clear()
        if last is not None:
            return self._sample[len(self._sample) - last :] if last else []
        return list(self._sample)

    def prompt_logprobs(self, once: bool) -> PromptLogprobs | None:
        """The prompt's logprobs once they arrived; with `once` (DELTA) only the first time,
        an empty list after."""
        if self.num_prompt_logprobs is None or self._prompt is None:
            return None
        if once:
            if self._prompt_taken:
                return []
            self._prompt_taken = True
        return self._prompt

    def _append(self, into: list, arrays: LogprobsArrays, num: int) -> None:
        width = arrays.token_ids.shape[1] if num == -1 else num + 1
        top_ranks = range(1, width)
        no_texts = [None] * width
        for ids, values, rank in zip(
            arrays.token_ids[:, :width].tolist(),
            arrays.logprobs[:, :width].tolist(),
            arrays.ranks.tolist(),
            strict=True,
        ):
            texts = no_texts if self.texts is None else self._texts(ids, into)
            ranks = [rank, *top_ranks]
            # the own token first; if it is among the top-k too, that entry's rank wins
            into.append(
                {t: Logprob(v, r, s) for t, v, r, s in zip(ids, values, ranks, texts, strict=True)}
            )

    def _texts(self, ids: list[int], into: list) -> list[str]:
        texts = [self.texts.text(t) for t in ids]
        if any(t.endswith(_REPLACEMENT) for t in texts):
            # a piece of a character: decoded with the tokens before it, as vLLM does
            context = [next(iter(d)) for d in into[-4:] if d is not None]
            texts = [
                self.texts.complete(t, context) if s.endswith(_REPLACEMENT) else s
                for t, s in zip(ids, texts, strict=True)
            ]
        return texts


class TokenTexts:
    """The text of single tokens, cached: `tokenizer.decode([id])`, with the leading spaces
    a SentencePiece-style (Metaspace) tokenizer's decode drops put back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._marker = _space_marker(tokenizer)
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            if self._marker is not None:
                raw = self.tokenizer.convert_ids_to_tokens(token_id) or ""
                markers = len(raw) - len(raw.lstrip(self._marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                text = " " * missing + text if missing > 0 else text
            self._cache[token_id] = text
        return text

    def complete(self, token_id: int, context: list[int]) -> str:
        """The text `token_id` completes after `context` (the tokens before it, oldest first),
        or "" while its character is still incomplete."""
        decode = self.tokenizer.decode
        for n in range(1, min(len(context), 4) + 1):
            ctx = context[-n:]
            full = decode(ctx + [token_id])
            if full.endswith(_REPLACEMENT):
                continue
            # context tokens that were pieces of this character belong to its text
            clean = len(ctx)
            while clean > 0 and self.text(ctx[clean - 1]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = decode(ctx[:clean]) if clean else ""
            return full[len(os.path.commonprefix([prefix, full])) :]
        return ""


def _space_marker(tokenizer: Tokenizer) -> str | None:
    """The Metaspace replacement character ("▁") if the tokenizer pre-tokenizes with one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return None
    for part in [pre, *pre.get("pretokenizers", [])]:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None
