"""What the engine-core checks of a request before it allocates anything for it.

The frontend checks all of this first, with messages that name the parameter; a daemon
serves any client, though, and one request whose ids fall outside the vocabulary or that
asks for a vocabulary's worth of logprobs per token would fail (or swamp) the step of every
request batched with it. Here it ends alone, with an error output.
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.config import ModelConfig
from minivllm.protocol.messages import EngineCoreRequest


def check_request(request: EngineCoreRequest, model: ModelConfig) -> None:
    """Raise ValueError if `request` asks for what its model cannot give."""
    params = request.sampling_params
    vocab = model.vocab_size
    groups: list[tuple[str, Iterable[int]]] = [
        ("prompt_token_ids", request.prompt_token_ids),
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words", [t for ids in params.bad_words_token_ids or () for t in ids]),
    ]
    if request.output_token_ids:
        groups.append(("output_token_ids", request.output_token_ids))
        _check_continuation(request, model)
    for name, ids in groups:
        ids = list(ids)
        if ids and not (min(ids) >= 0 and max(ids) < vocab):
            raise ValueError(f"{name}: token ids must be in 0..{vocab - 1}")
    max_logprobs = vocab if model.max_logprobs == -1 else model.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        num = getattr(params, name)
        if num is not None and (vocab if num == -1 else num) > max_logprobs:
            raise ValueError(f"{name}: at most {max_logprobs}, got {num}")


def _check_continuation(request: EngineCoreRequest, model: ModelConfig) -> None:
    """A continuation must have a token left to generate."""
    num_outputs = len(request.output_token_ids)
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and num_outputs >= max_tokens:
        raise ValueError(
            f"output_token_ids: {num_outputs} tokens already, max_tokens is {max_tokens}: "
            "nothing is left to generate"
        )
    total = len(request.prompt_token_ids) + num_outputs
    if total >= model.max_model_len:
        raise ValueError(
            f"output_token_ids: the prompt and its {num_outputs} output tokens ({total}) leave "
            f"no room within max_model_len ({model.max_model_len})"
        )
