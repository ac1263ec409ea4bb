"""The model's tokenizer: a ``tokenizers.Tokenizer`` plus the special tokens templates and stops need."""

from __future__ import annotations

from dataclasses import dataclass, field

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
