"""The one greedy allocator of the package.

Items (layers, or layer projections) each climb a ladder of levels (slots, grid points,
bit widths); each level has a cost (bytes) and a value (weighted slots, hits, negative
error). Starting from each item's first level, the allocator repeatedly takes the step
up that adds the most value per added cost while the total cost fits the budget. The
budget planner, the pool profiles and the bit allocation of ``requantize --target-gb``
all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def climb(
    levels: Sequence[int],
    cost: Callable[[int, int], float],
    value: Callable[[int, int], float],
    budget: float,
    start: Sequence[int] | None = None,
) -> list[int]:
    """Greedy levels for each item.

    Args:
        levels: Number of levels of each item.
        cost: ``cost(item, level)``, the item's total cost at that level.
        value: ``value(item, level)``, the item's total value at that level.
        budget: Bound on the summed cost.
        start: Each item's starting level (default 0).

    Returns:
        The chosen level of each item. A step that adds no cost is always taken first;
        ties go to the lower item.
    """
    at = list(start) if start is not None else [0] * len(levels)
    used = sum(cost(i, a) for i, a in enumerate(at))
    while True:
        best, best_gain, best_extra = None, 0.0, 0.0
        for i, a in enumerate(at):
            if a + 1 >= levels[i]:
                continue
            extra = cost(i, a + 1) - cost(i, a)
            if used + extra > budget:
                continue
            gain = (value(i, a + 1) - value(i, a)) / extra if extra > 0 else float("inf")
            if best is None or gain > best_gain:
                best, best_gain, best_extra = i, gain, extra
        if best is None:
            return at
        at[best] += 1
        used += best_extra
