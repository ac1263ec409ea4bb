"""KV-slot choice: a prompt reuses the slot that holds its prefix, and a new conversation, sharing only the
template's opening tokens with the slots, keeps away from the ones that hold other conversations."""

from lse_core.engine.kv_slots import KVSlots

OPENING = [1, 7, 8]   # e.g. <|im_start|>user\n, shared by every chat prompt


def test_a_new_conversation_takes_an_empty_slot_not_another_conversations() -> None:
    slots = KVSlots(3)
    first = OPENING + [20, 21, 22, 23]
    slot, cached = slots.acquire(first)
    slots.release(slot, first + [90, 91])
    other, cached = slots.acquire(OPENING + [30, 31])
    assert other != slot and cached == 0
    slots.release(other, OPENING + [30, 31, 92])
    again, cached = slots.acquire(first + [90, 91, 2, 1, 7, 8, 40])   # the first conversation's next turn
    assert again == slot and cached == len(first) + 2


def test_with_no_empty_slot_the_least_recently_released_is_overwritten() -> None:
    slots = KVSlots(2)
    a, b = OPENING + [20, 21, 22, 23, 24], OPENING + [30, 31, 32, 33, 34]
    slot_a, _ = slots.acquire(a)
    slot_b, _ = slots.acquire(b)
    slots.release(slot_a, a)
    slots.release(slot_b, b)
    slot, cached = slots.acquire(OPENING + [40, 41, 42])
    assert slot == slot_a and cached == 0


def test_a_repeated_prompt_reuses_its_slot_whatever_the_reply_length() -> None:
    slots = KVSlots(2)
    prompt = OPENING + [20]
    slot, _ = slots.acquire(prompt)
    slots.release(slot, prompt + list(range(100, 140)))
    again, cached = slots.acquire(prompt)
    assert again == slot and cached == len(prompt) - 1
