"""The persistent block table: rows follow the KV cache manager's id lists, step to step."""

from __future__ import annotations

import pytest

from engine.block_table import BlockTable


def own(table, lists, width):
    """Each gathered row's entries that belong to its request."""
    return [row[: min(len(ids), width)] for row, ids in zip(table.tolist(), lists, strict=True)]


def test_rows_follow_appends_and_new_lists():
    table = BlockTable(num_rows=4, max_blocks=8)
    a, b = [3, 1], [7]
    assert own(table.gather(["a", "b"], [a, b], 2), [a, b], 2) == [[3, 1], [7]]
    a.append(5)  # the manager appended a block: only it is written
    b.extend([2, 4])
    assert own(table.gather(["b", "a"], [b, a], 3), [b, a], 3) == [[7, 2, 4], [3, 1, 5]]
    a_again = [9]  # preempted and readmitted: a new list, shorter, other ids
    assert table.gather(["a"], [a_again], 3).tolist()[0] == [9, 0, 0]
    assert table.gather(["a"], [a_again], 1).tolist() == [[9]]
    table.release("a")
    table.release("b")
    table.release("never")
    assert table.num_rows_used == 0
    assert table.table.count_nonzero() == 0  # released rows are cleared
    for name in "cdef":  # and free again: four more fit without taking any back
        table.gather([name], [[8]], 1)
    assert table.num_rows_used == 4


def test_a_full_table_takes_back_the_least_recent_row_not_in_the_step():
    table = BlockTable(num_rows=2, max_blocks=4)
    lists = {"a": [1], "b": [2], "c": [3]}
    table.gather(["a"], [lists["a"]], 1)
    table.gather(["b"], [lists["b"]], 1)
    assert table.gather(["c", "b"], [lists["c"], lists["b"]], 1).tolist() == [[3], [2]]
    assert table.gather(["a", "c"], [lists["a"], lists["c"]], 1).tolist() == [[1], [3]]
    with pytest.raises(RuntimeError, match="block table full"):
        table.gather(["a", "b", "c"], [lists["a"], lists["b"], lists["c"]], 1)


def test_a_request_longer_than_a_row_is_an_error():
    table = BlockTable(num_rows=1, max_blocks=2)
    with pytest.raises(ValueError, match="room for 2"):
        table.gather(["a"], [[1, 2, 3]], 3)
