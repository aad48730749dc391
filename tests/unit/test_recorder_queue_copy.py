"""The drain thread copies the head of the hooks' queue while the host's threads append. A garbage
collection inside that one C call can run Python code and let a thread append, and the copy raises
RuntimeError ("deque mutated during iteration"); it disabled the hooks (a 100k-event run through launch
lost two thirds of its events once). The copy is tried again instead."""

from __future__ import annotations

from collections import deque
from typing import Any

from infersight.hooks import _recorder


class _MutatedOnce(deque):  # type: ignore[type-arg]
    """A deque whose first iteration fails as one mutated by another thread does."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.fails = 1

    def __iter__(self) -> Any:
        if self.fails:
            self.fails -= 1
            raise RuntimeError("deque mutated during iteration")
        return super().__iter__()


def test_a_copy_that_meets_a_mutation_is_tried_again() -> None:
    q = _MutatedOnce([(1, 10, "span", "load", "s", "p", 5, 9, {}), (2, 11, "log", {})])
    assert _recorder._copy(q, 1) == [(1, 10, "span", "load", "s", "p", 5, 9, {})]
    assert q.fails == 0


def test_a_copy_that_keeps_failing_gives_nothing_rather_than_raising() -> None:
    q = _MutatedOnce([(1, 10, "log", {})])
    q.fails = 100
    assert _recorder._copy(q) == []
