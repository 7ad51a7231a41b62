"""The ``offload`` connector's slot index: lowest free slot first, least recently used evicted,
never an entry with a transfer in flight; checked against a simple model."""

from __future__ import annotations

import random

from kvcore.connectors.offload.slots import SlotIndex


def test_in_flight_blocks_are_never_evicted():
    index = SlotIndex(3)
    for key in ("a", "b", "c"):
        index.allocate(key)
    index.get("a").pins += 1  # a save or load of "a" is running
    index.get("b").pins += 1
    entry = index.allocate("d")  # "a" is least recently used, but in flight
    assert entry is not None and index.keys() == ["a", "b", "d"]
    index.get("d").pins += 1
    assert index.allocate("e") is None  # every slot in flight: nothing to evict
    assert index.keys() == ["a", "b", "d"] and index.evictions == 1


def test_kept_entries_are_never_evicted():
    index = SlotIndex(3)
    for key in ("a", "b", "c"):
        index.allocate(key)
    entry = index.allocate("d", keep={"a"})  # "a" is least recently used, but kept
    assert entry.slot == 1 and index.keys() == ["a", "c", "d"]
    index.get("d").pins += 1
    assert index.allocate("e", keep={"a", "c"}) is None  # the rest kept or in flight
    assert index.keys() == ["a", "c", "d"] and index.evictions == 1


def test_free_slots_are_handed_out_lowest_first():
    index = SlotIndex(6)
    assert [index.allocate(k).slot for k in "abcd"] == [0, 1, 2, 3]
    index.discard("b")
    index.discard("a")
    assert [index.allocate(k).slot for k in "efg"] == [0, 1, 4]
    assert len(index) == 5 and index.evictions == 0


class ModelIndex:
    """The same contract written as plainly as possible."""

    def __init__(self, num_slots: int) -> None:
        self.order: list[str] = []  # least recently used first
        self.slot: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.free = set(range(num_slots))
        self.evictions = 0

    def get(self, key: str) -> int | None:
        if key not in self.slot:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.slot[key]

    def allocate(self, key: str) -> int | None:
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
        else:
            victims = [k for k in self.order if self.pins[k] == 0]
            if not victims:
                return None
            slot = self.slot.pop(victims[0])
            self.order.remove(victims[0])
            del self.pins[victims[0]]
            self.evictions += 1
        self.order.append(key)
        self.slot[key] = slot
        self.pins[key] = 0
        return slot

    def discard(self, key: str) -> None:
        self.free.add(self.slot.pop(key))
        self.order.remove(key)
        del self.pins[key]


def test_random_operations_match_the_model():
    rnd = random.Random(random.randrange(2**31))
    for _ in range(20):
        num_slots = rnd.randint(1, 8)
        index, model = SlotIndex(num_slots), ModelIndex(num_slots)
        next_key = 0
        for _ in range(300):
            op = rnd.choice(["allocate", "allocate", "get", "pin", "unpin", "discard"])
            known = model.order
            if op == "allocate":
                key = f"k{next_key}"
                next_key += 1
                entry, slot = index.allocate(key), model.allocate(key)
                assert (entry.slot if entry is not None else None) == slot
            elif not known:
                continue
            elif op == "get":
                key = rnd.choice([*known, "absent"])
                entry, slot = index.get(key), model.get(key)
                assert (entry.slot if entry is not None else None) == slot
            elif op == "pin":
                key = rnd.choice(known)
                index.get(key).pins += 1
                model.get(key)
                model.pins[key] += 1
            elif op == "unpin":
                pinned = [k for k in known if model.pins[k]]
                if pinned:
                    key = rnd.choice(pinned)
                    index.get(key).pins -= 1
                    model.get(key)
                    model.pins[key] -= 1
            else:
                key = rnd.choice(known)
                index.discard(key)
                model.discard(key)
            assert index.keys() == model.order
            assert len(index) == len(model.order) and index.evictions == model.evictions
            slots = [model.slot[k] for k in model.order]
            assert len(set(slots)) == len(slots) and all(0 <= s < num_slots for s in slots)
