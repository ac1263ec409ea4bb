"""The model's tokenizer: a ``tokenizers.Tokenizer`` plus the special tokens templates and stops need."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream


@dataclass
class Tokenizer:
    backend: tokenizers.Tokenizer
    eos_ids: tuple[int, ...]                          # any of these ends a reply
    bos_token: str | None = None
    eos_token: str | None = None
    special: dict[str, str] = field(default_factory=dict)  # pad_token, unk_token... for templates

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Chat prompts are rendered with their own special tokens (add_special_tokens=False, as
        transformers' apply_chat_template does); plain completions get the tokenizer's (bos...)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to a text. A byte-level or byte-fallback token can hold part of a
        UTF-8 character, which ``decode`` turns into U+FFFD; logprobs report the real bytes."""
        added = self._added_tokens.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        return self._spelling.piece_bytes(self.backend.id_to_token(token_id))

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for (read once, over the whole vocabulary)."""
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    def longest_text(self, tokens: int) -> int:
        """A bound on the UTF-8 bytes of a text that encodes to at most ``tokens`` tokens, so a longer one is
        refused before it is tokenized. A normalizer can shrink text before it is split (NFKC turns a
        4-byte character into one byte at most; stripping accents, 3 bytes into 1), hence the factor 4."""
        shrink = 1 if self.backend.normalizer is None else 4
        return tokens * self.max_token_bytes * shrink

    @cached_property
    def _added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    @cached_property
    def _spelling(self) -> PieceSpelling:
        decoder = self.backend.decoder
        return PieceSpelling.of(json.loads(decoder.__getstate__()) if decoder is not None else {})

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental detokenizer: ``.step(self.backend, id)`` returns new text or None while a
        UTF-8 character is still incomplete."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def template_variables(self) -> dict[str, str]:
        """bos_token, eos_token and the other named special tokens, as chat templates expect them."""
        names = dict(self.special)
        if self.bos_token is not None:
            names["bos_token"] = self.bos_token
        if self.eos_token is not None:
            names["eos_token"] = self.eos_token
        return names


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    others for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_LEVEL = _byte_level_alphabet()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class PieceSpelling:
    """How a decoder spells bytes in vocabulary pieces, read from the decoder's JSON: the GPT-2 byte
    alphabet (ByteLevel), <0xNN> pieces (ByteFallback), and characters that stand for others (Replace,
    Metaspace's "▁"). Whole-text steps (Strip, Fuse) do not change what one token adds."""
    byte_level: bool = False
    byte_fallback: bool = False
    replacements: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, decoder: dict[str, Any]) -> PieceSpelling:
        steps = _flatten(decoder)
        kinds = {step.get("type") for step in steps}
        replacements = tuple((step["pattern"]["String"], step["content"]) for step in steps
                             if step.get("type") == "Replace" and "String" in step.get("pattern", {}))
        replacements += tuple((step["replacement"], " ") for step in steps if step.get("type") == "Metaspace")
        return cls("ByteLevel" in kinds, "ByteFallback" in kinds, replacements)

    def piece_bytes(self, piece: str) -> bytes:
        if self.byte_fallback and (byte := BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(byte[1], 16)])
        if self.byte_level:
            return b"".join(bytes([BYTE_LEVEL[c]]) if c in BYTE_LEVEL else c.encode("utf-8") for c in piece)
        for old, new in self.replacements:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")


def _flatten(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder["decoders"] for step in _flatten(inner)]
    return [decoder]
