"""KV-cache slots. The cache memory lives on the devices (each attention kernel owns its layer's
cache, indexed by slot); the engine only hands out slots. A freed slot remembers the tokens it
holds, so a new prompt that starts with them (the next turn of a chat) reuses that prefix."""

from __future__ import annotations


class KVSlots:
    def __init__(self, n_slots: int) -> None:
        self.free: list[int] = list(range(n_slots))
        self.contents: dict[int, list[int]] = {}   # slot -> tokens whose K/V it holds

    @property
    def n_free(self) -> int:
        return len(self.free)

    def acquire(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot and how many leading prompt tokens it already holds (at most len - 1, so the
        last prompt token is always computed and yields logits).

        The slot holding the longest prefix of the prompt, if that prefix is the whole prompt or at least
        half the slot's tokens (a chat's next turn, a repeated prompt); otherwise an empty slot, else the
        least recently released one (the free list is in release order). So a new conversation, which
        shares only the template's opening tokens with any slot, does not overwrite another's for them."""
        best, best_len = None, 0
        for slot in self.free:
            content = self.contents.get(slot, [])
            n = _common_prefix(content, prompt)
            if n > best_len and (n == len(prompt) or 2 * n >= len(content)):
                best, best_len = slot, n
        if best is None:
            best = next((slot for slot in self.free if not self.contents.get(slot)), self.free[0])
        self.free.remove(best)
        return best, min(best_len, len(prompt) - 1)

    def release(self, slot: int, tokens: list[int]) -> None:
        """Return a slot; ``tokens`` are those whose K/V were written to it."""
        self.contents[slot] = tokens
        self.free.append(slot)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
