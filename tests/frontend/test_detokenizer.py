"""Incremental detokenization and stop strings with the tiny byte-level BPE tokenizer,
through both decoders: the byte-level table and the general DecodeStream one."""

from __future__ import annotations

import random

import pytest

from minivllm.frontend import detokenizer
from minivllm.frontend.detokenizer import (
    ByteLevelDecoder,
    IncrementalDetokenizer,
    StreamDecoder,
    byte_level_table,
    find_stop_string,
)
from minivllm.frontend.tokenizer import Tokenizer, load_tokenizer
from minivllm.protocol.messages import FinishReason
from minivllm.protocol.sampling_params import SamplingParams

PROMPT = "Hello world!"


@pytest.fixture(scope="module")
def byte_level_tokenizer(qwen3_dir: str) -> Tokenizer:
    return load_tokenizer(qwen3_dir)


@pytest.fixture(params=["byte-level", "stream"])
def tokenizer(request, byte_level_tokenizer: Tokenizer, monkeypatch) -> Tokenizer:
    """The tokenizer, decoded by the table or (as any other tokenizer is) by DecodeStream."""
    if request.param == "stream":
        monkeypatch.setattr(detokenizer, "byte_level_table", lambda *args: None)
    return byte_level_tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_decoder_gives_the_stream_decoders_text(
    byte_level_tokenizer, skip_special_tokens
):
    table = byte_level_table(byte_level_tokenizer, skip_special_tokens)
    assert table is not None
    # valid text, a character split over several ids: the same text at every step
    fast, general = ByteLevelDecoder(table), StreamDecoder(byte_level_tokenizer, True, [])
    for token_id in byte_level_tokenizer.encode("你好 😀 héllo, world"):
        assert fast.decode([token_id]) == general.decode([token_id])
    # any ids (bytes that never form UTF-8 show as '�' at different steps): the same text
    rng = random.Random(1)
    for _ in range(100):
        fast = ByteLevelDecoder(table)
        general = StreamDecoder(byte_level_tokenizer, skip_special_tokens, [])
        texts = ["", ""]
        for _ in range(rng.randrange(1, 20)):
            ids = [rng.randrange(384) for _ in range(rng.randrange(4))]
            texts[0] += fast.decode(ids)
            texts[1] += general.decode(ids)
        assert texts[0] + fast.flush() == texts[1] + general.flush()


def stream(
    tokenizer: Tokenizer,
    ids: list[int],
    params: SamplingParams,
    chunks: list[int] | None = None,
    finish_reason: FinishReason = FinishReason.LENGTH,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `ids` in steps of `chunks` sizes (default 1); return the detokenizer, the DELTA
    texts released per step and the stop string hit."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), params)
    deltas: list[str] = []
    pos, step = 0, 0
    while pos < len(ids):
        size = chunks[step % len(chunks)] if chunks else 1
        new, pos, step = ids[pos : pos + size], pos + size, step + 1
        done = pos >= len(ids)
        hit = detok.update(new, finish_reason if done else None)
        deltas.append(detok.get_next_output_text(done or hit is not None, delta=True))
        if hit is not None:
            return detok, deltas, hit
    return detok, deltas, None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_decode_like_the_whole_sequence(tokenizer, skip_special_tokens):
    # ids up to the model's padded vocab (384 > the tokenizer's 376), specials and bytes
    # that never form valid UTF-8 included
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(200):
        ids = [rng.randrange(384) for _ in range(rng.randrange(1, 40))]
        chunks = [rng.randrange(1, 5) for _ in range(4)]
        detok, deltas, _ = stream(tokenizer, ids, params, chunks)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected
        assert "".join(deltas) == expected


def test_split_multibyte_chars_are_withheld_until_complete(tokenizer):
    text = "你好 😀 héllo"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # several tokens per character: the test means something
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams())
    assert all("�" not in d for d in deltas)
    assert "" in deltas  # a step that only carried part of a character showed nothing
    assert "".join(deltas) == detok.output_text == text


def test_incomplete_char_at_the_end_is_released_when_finished(tokenizer):
    ids = tokenizer.encode("ab😀")[:-1]  # the emoji's last byte never comes
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams())
    assert detok.output_text == tokenizer.decode(ids) == "".join(deltas)
    assert detok.output_text.startswith("ab") and detok.output_text.endswith("�")


def test_stop_string_spanning_two_tokens_truncates_the_text(tokenizer):
    ids = tokenizer.encode("Hello world! How are you today?")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[9:11] == ["re", " you"]  # so "e y" spans two tokens
    detok, deltas, hit = stream(tokenizer, ids, SamplingParams(stop=["zzz", "e y"]))
    assert hit == "e y"
    assert detok.output_text == "Hello world! How ar"
    assert "".join(deltas) == detok.output_text


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("Hello world! How are you today?")
    params = SamplingParams(stop=["are"], include_stop_str_in_output=True)
    detok, deltas, hit = stream(tokenizer, ids, params)
    assert hit == "are"
    assert detok.output_text == "Hello world! How are"
    assert "".join(deltas) == detok.output_text


def test_earliest_stop_string_wins_within_one_step(tokenizer):
    ids = tokenizer.encode("Hello world! How are you today?")
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=["you", "How"]), chunks=[100])
    assert hit == "How"
    assert detok.output_text == "Hello world! "


def test_possible_stop_string_start_is_held_back_while_streaming(tokenizer):
    ids = tokenizer.encode("Hello world! How are you today?")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["Howdy"]))
    released = ""
    for token_id in ids:
        assert detok.update([token_id], None) is None
        released += detok.get_next_output_text(finished=False, delta=True)
        # the last len("Howdy") - 1 characters could still start the stop string
        assert released == detok.output_text[: max(len(detok.output_text) - 4, 0)]
        assert detok.get_next_output_text(finished=False, delta=False) == released
    released += detok.get_next_output_text(finished=True, delta=True)
    assert released == "Hello world! How are you today?"


def test_stop_token_text_is_left_out_unless_asked_for(tokenizer):
    ids = tokenizer.encode("Hello world") + [tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    detok, _, _ = stream(tokenizer, ids, params, finish_reason=FinishReason.STOP)
    assert detok.output_text == "Hello world"
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok, _, _ = stream(tokenizer, ids, params, finish_reason=FinishReason.STOP)
    assert detok.output_text == "Hello world<|endoftext|>"


def test_stop_strings_are_ignored_before_min_tokens(tokenizer):
    ids = tokenizer.encode("Hello world! Hello world!")
    detok, _, hit = stream(tokenizer, ids, SamplingParams(stop=["Hello"], min_tokens=2))
    assert hit == "Hello"
    assert detok.output_text == "Hello world! "


def test_find_stop_string_searches_only_the_new_tail():
    # "ab" is old text that earlier steps already searched
    assert find_stop_string("abXcd", 3, ["ab"], False) is None
    assert find_stop_string("abXcd", 3, ["Xc"], False) == ("Xc", 2)
    assert find_stop_string("abXcd", 1, ["Xcd"], True) == ("Xcd", 5)
    assert find_stop_string("abXcd", 0, ["d"], False) is None
