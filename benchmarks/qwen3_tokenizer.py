"""Build Qwen3's tokenizer (HF format) offline, for benchmarks on dummy weights that need one.

Structured outputs compile grammars against the tokenizer's vocabulary, so a benchmark of
them on the Qwen3-0.6B geometry needs Qwen3's real 151,643 byte-level BPE tokens (plus its 26
special tokens), not a toy vocabulary. The ranks come from `qwen.tiktoken`, which the
Apache-2.0 `dashscope` wheel on PyPI ships; this script turns them into a `tokenizer.json`
(vocabulary, merges recovered from the ranks, Qwen2's pre-tokenizer split) that loads with
`AutoTokenizer` and needs no network afterwards:

    python benchmarks/qwen3_tokenizer.py --out benchmarks/.qwen3-tokenizer
    python benchmarks/qwen3_tokenizer.py --tiktoken qwen.tiktoken --out DIR   # a local copy
"""

from __future__ import annotations

import argparse
import base64
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

DASHSCOPE = "dashscope==2.0.2"
# Qwen2/Qwen3's pre-tokenizer split (single digits, unlike GPT-4's runs of three)
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def fetch_ranks_file(tmp: str) -> str:
    """qwen.tiktoken out of the dashscope wheel (downloaded with pip, no dependencies)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", DASHSCOPE, "--no-deps", "-q", "-d", tmp],
        check=True,
    )
    (wheel,) = glob.glob(os.path.join(tmp, "dashscope-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        return z.extract("dashscope/resources/qwen.tiktoken", tmp)


def load_ranks(path: str) -> dict[bytes, int]:
    with open(path, "rb") as f:
        return {
            base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in f if ln.strip())
        }


def build(ranks: dict[bytes, int], out_dir: str) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_chars[c] for c in b)

    # every split of a token into two lower-ranked tokens is a merge that makes it, ranked
    # by the token it makes: BPE then reaches each token whichever pieces come first
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None:
                merges.append((rank, left, right, text(token[:i]), text(token[i:])))
    merges.sort()
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    tok = Tokenizer(models.BPE(vocab, [m[3:] for m in merges], fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write the tokenizer files to")
    p.add_argument("--tiktoken", default=None, help="a local qwen.tiktoken (else from PyPI)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = load_ranks(args.tiktoken or fetch_ranks_file(tmp))
    if len(ranks) != 151643:
        raise SystemExit(f"expected Qwen's 151,643 BPE tokens, got {len(ranks)}")
    build(ranks, args.out)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(args.out)
    ids = t.encode('{"name": "Qwen3", "layers": 28}')
    assert t.decode(ids) == '{"name": "Qwen3", "layers": 28}'
    print(f"wrote {args.out}: {len(t)} tokens; {t.convert_ids_to_tokens(ids)}")


if __name__ == "__main__":
    main()
