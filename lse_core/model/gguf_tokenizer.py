"""A GGUF file's tokenizer.ggml.* metadata -> a ``tokenizers.Tokenizer`` that encodes like the model's own.

Two vocabulary kinds, as llama.cpp names them in tokenizer.ggml.model:

  gpt2   byte-level BPE: tokens are spelled in GPT-2's byte alphabet, merges are stored, and
         tokenizer.ggml.pre names the regex that splits text before the merges run.
  llama  SentencePiece BPE: tokens spelled with "▁" for a space, byte-fallback tokens <0xNN>, and
         no merges: they are rebuilt from the vocabulary, a merge ranked by the position of the
         piece it makes. SentencePiece stores pieces best first, so position is the normal pieces'
         score order; it is also right for Gemma's whitespace pieces, whose stored score (-1000,
         as a user-defined piece) would wrongly rank them last.

Tokens marked CONTROL become special added tokens, USER_DEFINED ones plain added tokens, so both
are matched whole in text (as llama.cpp does).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from lse_core.errors import StartupError

from .tokenizer import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regexes applied one after another (llama.cpp's llama-vocab.cpp).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}

# Control tokens llama.cpp treats as end of generation besides eos/eot/eom (llama-vocab.cpp), so a
# chat reply stops at its end-of-turn token even when the file's eos is another token.
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})


def build_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """The tokenizer that ``meta`` (GGUF key -> value, tokenizer.ggml.* at least, of the types gguf.py
    checks) describes."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))

    def token_id(key: str) -> int | None:
        """A special token's id; one outside the vocabulary is ignored, as llama.cpp ignores it."""
        index = meta.get(f"tokenizer.ggml.{key}")
        return index if index is not None and 0 <= index < len(tokens) else None

    if kind == "llama":
        # Gemma's files spell its whitespace pieces with real spaces, where SentencePiece text has
        # "▁": respelled, they are ordinary BPE pieces rather than text matched whole.
        spelled = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
        types = [NORMAL if s != t else k for s, t, k in zip(spelled, tokens, types)]
        tokens = spelled
    elif kind != "gpt2":
        raise StartupError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):   # a repeated token would leave an id that no token has
        if first.setdefault(t, i) != i:
            raise StartupError(f"{source}: token {i} of tokenizer.ggml.tokens, {t!r}, repeats token {first[t]}")

    try:   # tokenizers raises a bare Exception for a vocabulary it cannot build (a merge of unknown tokens...)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta, source)
        else:
            backend = _sentencepiece_bpe(tokens, token_id("unknown_token_id"), meta)
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
        _set_post_processor(backend, meta, kind, tokens, token_id("bos_token_id"), token_id("eos_token_id"))
    except StartupError:
        raise
    except Exception as e:
        raise StartupError(f"{source}: the tokenizer.ggml metadata is not a vocabulary tokenizers can build: {e}") \
            from None

    def token(key: str) -> str | None:
        index = token_id(key)
        return tokens[index] if index is not None else None

    end_ids = [i for i in map(token_id, ("eos_token_id", "eot_token_id", "eom_token_id")) if i is not None]
    end_ids += [i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL and t in END_OF_GENERATION_TEXTS]
    special = {name: text for name, text in (("pad_token", token("padding_token_id")),
                                             ("unk_token", token("unknown_token_id"))) if text is not None}
    return Tokenizer(backend, eos_ids=tuple(dict.fromkeys(end_ids)), bos_token=token("bos_token_id"),
                     eos_token=token("eos_token_id"), special=special)


def _byte_level_bpe(tokens: list[str], meta: dict[str, Any], source: str) -> BackendTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre == "default":
        pre = "gpt-2"
    if pre not in PRE_TOKENIZER_SPLITS:
        raise StartupError(f"{source}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                           f"known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = BackendTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], unk: int | None, meta: dict[str, Any]) -> BackendTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []   # in rank order: by the merged piece's position, then the longer left part first
    for piece in tokens:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    backend = BackendTokenizer(models.BPE(
        vocab, merges, fuse_unk=True, byte_fallback=True,
        unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _set_post_processor(backend: BackendTokenizer, meta: dict[str, Any], kind: str, tokens: list[str],
                        bos_id: int | None, eos_id: int | None) -> None:
    # llama.cpp's converter marks byte-level vocabularies add_bos even where the model's own
    # tokenizer adds none (SmolLM2); transformers and tokenizer.json add none there, so only
    # SentencePiece vocabularies honour the flag.
    add_bos = kind == "llama" and bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if not (add_bos or add_eos):
        return
    around = [(bos_id, add_bos), (eos_id, add_eos)]
    single = " ".join(([f"{tokens[bos_id]}:0"] if add_bos else []) + ["$A:0"]
                      + ([f"{tokens[eos_id]}:0"] if add_eos else []))
    backend.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(tokens[i], i) for i, added in around if added])
