"""How a worker thread frees a large value the writer let go of (`_drain._take_apart`):
everything it alone holds is freed, a slice at a time - one C call frees at most
`FREE_SLICE` leaves, so the event loop's thread, waiting for the GIL, gets it back between
slices - and a value another holder still sees is never changed."""

from __future__ import annotations

import gc
import itertools
import sys
import weakref
from typing import Any

from trio_sessions import _drain
from trio_sessions._drain import FREE_SLICE


class Leaf:
    """A leaf that says when it is freed, and with which others."""

    freed: list[int] = []  # noqa: RUF012 - one log for the test

    def __init__(self, n: int) -> None:
        self.n = n

    def __del__(self) -> None:
        Leaf.freed.append(self.n)


def test_everything_held_only_here_is_freed_and_shared_values_are_left_whole() -> None:
    """Nested lists and dicts (a wide list, a deep chain, a dict of lists) are freed whole;
    a list and a dict another holder sees keep every item; the list given is emptied."""
    gc.disable()  # freed by their last reference, not a collection
    try:
        leaves = [Leaf(n) for n in range(5 * FREE_SLICE)]
        refs = [weakref.ref(leaf) for leaf in leaves]
        wide = list(leaves[: 3 * FREE_SLICE])
        deep: Any = leaves[3 * FREE_SLICE]
        for _ in range(500):
            deep = [deep]
        keyed = {
            f"k{n}": [leaf, {"x": leaf}] for n, leaf in enumerate(leaves[3 * FREE_SLICE + 1 :])
        }
        shared_list = [1, [2, 3], {"a": [4]}]
        shared_dict = {"a": [5, 6], "b": {"c": 7}}
        values: list[Any] = [wide, deep, keyed, [shared_list], {"s": shared_dict}]
        del leaves, wide, deep, keyed
        _drain._take_apart(values)
        assert values == []
        assert [ref for ref in refs if ref() is not None] == []
        assert shared_list == [1, [2, 3], {"a": [4]}]
        assert shared_dict == {"a": [5, 6], "b": {"c": 7}}
    finally:
        gc.enable()
        Leaf.freed.clear()


def test_one_free_frees_at_most_a_slice_of_leaves() -> None:
    """Between two frees of leaves the thread runs Python again (where the interpreter can
    hand the GIL to the event loop's thread): a list of 10 slices of leaves is freed in
    runs of at most `FREE_SLICE`, told apart by a Python-level step between them - here, a
    trace of the frame's lines, which runs only between C calls."""
    gc.disable()
    runs: list[int] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is _drain._take_apart.__code__ and event == "line":
            runs.append(len(Leaf.freed))
        return trace

    try:
        values: list[Any] = [[Leaf(n) for n in range(10 * FREE_SLICE)]]
        sys.settrace(trace)
        try:
            _drain._take_apart(values)
        finally:
            sys.settrace(None)
        assert len(Leaf.freed) == 10 * FREE_SLICE
        counts = [*runs, len(Leaf.freed)]
        assert max(b - a for a, b in itertools.pairwise(counts)) <= FREE_SLICE
    finally:
        gc.enable()
        Leaf.freed.clear()


class _CountingLower:
    """`sys` as `_drain` sees it, on an interpreter whose `getrefcount` reads one lower than
    3.11-3.13 do wherever it is called: CPython 3.14 passes a local variable's object as a
    borrowed reference (LOAD_FAST_BORROW), so a list a local alone holds reads 1, and one
    another holder sees too reads 2."""

    @staticmethod
    def getrefcount(value: Any) -> int:
        # Less this call's argument and its name here: on 3.11-3.13, 1 for a local held once.
        return sys.getrefcount(value) - 2


class _CountingBlind:
    """`sys` on an interpreter whose counts tell nothing: every object reads 1."""

    @staticmethod
    def getrefcount(value: Any) -> int:
        return 1


def test_a_shared_value_is_left_whole_however_the_interpreter_counts(monkeypatch: Any) -> None:
    """Whatever `sys.getrefcount` reads for an object held once (3.14's borrowed references
    read one lower) or if it tells sharing not at all, a list or dict another holder sees
    keeps every item, and what is held only here is still freed."""
    for counting in (_CountingLower, _CountingBlind):
        monkeypatch.setattr(_drain, "sys", counting)
        gc.disable()
        try:
            leaves = [Leaf(n) for n in range(3 * FREE_SLICE)]
            refs = [weakref.ref(leaf) for leaf in leaves]
            shared_list = [1, [2, 3], {"a": [4]}]
            shared_dict = {"a": [5, 6], "b": {"c": 7}}
            values: list[Any] = [[leaves], shared_list, {"s": shared_dict}, shared_dict]
            del leaves
            _drain._take_apart(values)
            assert values == []
            assert [ref for ref in refs if ref() is not None] == []
            assert shared_list == [1, [2, 3], {"a": [4]}], counting
            assert shared_dict == {"a": [5, 6], "b": {"c": 7}}, counting
        finally:
            gc.enable()
            Leaf.freed.clear()
