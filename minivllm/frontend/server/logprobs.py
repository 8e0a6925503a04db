"""OpenAI's logprobs formats, from `CompletionOutput.logprobs` (one `{token_id: Logprob}`
per token, each Logprob with `.logprob`, `.rank` and `.decoded_token`).

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
`top_logprobs` entry maps the token text of the sampled token and the `logprobs` best
tokens to their logprob. Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}]}`. Logprobs are floored at -9999 (a -inf is not JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_FLOOR = -9999.0


def _token_text(token_id: int, logprob: Any) -> str:
    text = getattr(logprob, "decoded_token", None)
    return text if text is not None else f"token_id:{token_id}"


def _value(logprob: Any) -> float:
    return max(logprob.logprob, _FLOOR)


def _by_rank(step: dict[int, Any]) -> list[tuple[int, Any]]:
    return sorted(step.items(), key=lambda item: item[1].rank)


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Any] | None],
    num_top: int,
    text_offset: int = 0,
    decode: Callable[[int], str] | None = None,
) -> dict[str, list]:
    """One completion's (or one chunk's) logprobs; `text_offset` is where its text starts in
    the choice's text (a stream's later chunks start after the earlier ones). A None step
    (the first token of an echoed prompt) has no logprob; `decode` names its token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        if step is None:
            text = decode(token_id) if decode is not None else f"token_id:{token_id}"
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            sampled = step.get(token_id)
            text = _token_text(token_id, sampled)
            token_logprobs.append(_value(sampled) if sampled is not None else None)
            top = {} if sampled is None else {text: _value(sampled)}
            for other_id, other in _by_rank(step)[:num_top]:
                top.setdefault(_token_text(other_id, other), _value(other))
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def _chat_entry(token_id: int, logprob: Any) -> dict[str, Any]:
    text = _token_text(token_id, logprob)
    return {
        "token": text,
        "logprob": _value(logprob),
        "bytes": list(text.encode("utf-8", errors="replace")),
    }


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Any]], num_top: int
) -> dict[str, list]:
    """One choice's (or one chunk's) logprobs in the chat format."""
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        entry = _chat_entry(token_id, step[token_id])
        entry["top_logprobs"] = [_chat_entry(i, lp) for i, lp in _by_rank(step)[:num_top]]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_json(
    prompt_logprobs: list[dict[int, Any] | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, `{id: {logprob, rank, decoded_token}}`."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(i): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for i, lp in step.items()
        }
        for step in prompt_logprobs
    ]
