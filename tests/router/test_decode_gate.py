"""The decode gate's line: first come first served among equal priorities, smaller
priority values first, woken one at a time, and a waiter that is cancelled (its client
left) leaves the line without stalling the ones behind it. What
is ahead on a decode worker: full prompt blocks counted once however many share them."""

from __future__ import annotations

import asyncio

from common.hashing import hash_blocks
from router.decode_gate import Ahead, DecodeGate


def test_the_line_is_fifo_and_survives_a_cancelled_head():
    async def scenario() -> list[str]:
        gate, room, passed = DecodeGate(), [0], []

        def has_room() -> bool:
            return room[0] > 0

        async def one(name: str) -> None:
            await gate.enter(has_room)
            room[0] -= 1  # it takes the room it found
            passed.append(name)

        waiters = {}
        for name in "abcd":
            waiters[name] = asyncio.create_task(one(name))
            await asyncio.sleep(0.01)
        assert len(gate) == 4 and not passed
        waiters["a"].cancel()  # the head's client leaves
        await asyncio.sleep(0.01)
        assert len(gate) == 3
        room[0] = 2
        gate.wake()  # as a finished decode stream does
        await asyncio.sleep(0.01)
        assert passed == ["b", "c"] and len(gate) == 1  # each let through woke the next
        room[0] = 1
        gate.wake()
        await asyncio.wait_for(waiters["d"], 1)
        await asyncio.sleep(0)
        await gate.enter(lambda: True)  # nobody in line and room: straight through
        return passed

    assert asyncio.run(scenario()) == ["b", "c", "d"]


def test_smaller_priority_values_go_first():
    async def scenario() -> list[str]:
        gate, room, passed = DecodeGate(), [0], []

        def has_room() -> bool:
            return room[0] > 0

        async def one(name: str, priority: int) -> None:
            await gate.enter(has_room, priority)
            room[0] -= 1
            passed.append(name)

        tasks = []
        for name, priority in [("low-1", 5), ("mid", 1), ("low-2", 5), ("high", -1)]:
            tasks.append(asyncio.create_task(one(name, priority)))
            await asyncio.sleep(0.01)
        assert len(gate) == 4 and not passed
        room[0] = 1
        gate.wake()
        await asyncio.sleep(0.01)
        assert passed == ["high"]
        # A late arrival of a smaller value passes the whole line and finds the room
        # itself: nobody has to wake it.
        room[0] = 1
        tasks.append(asyncio.create_task(one("urgent", -5)))
        await asyncio.sleep(0.01)
        assert passed == ["high", "urgent"]
        room[0] = 3
        gate.wake()
        await asyncio.wait_for(asyncio.gather(*tasks), 1)
        assert len(gate) == 0
        return passed

    assert asyncio.run(scenario()) == ["high", "urgent", "mid", "low-1", "low-2"]


def test_ahead_counts_shared_prompt_blocks_once():
    ahead = Ahead()
    prefix = list(range(32))  # two full blocks of 16
    prompts = [prefix + [100, 101], prefix + [200], list(range(50, 98))]
    hashes = [hash_blocks(p, 16) for p in prompts]
    leave_a = ahead.join(hashes[0], 3)
    assert (ahead.num_seqs, ahead.num_blocks) == (1, 3)
    assert ahead.num_blocks_with(hashes[1], 3) == 4  # only its partial last block is new
    assert ahead.num_blocks_with(hashes[2], 3) == 6  # nothing shared
    leave_b = ahead.join(hashes[1], 3)
    leave_c = ahead.join(hashes[2], 3)
    assert (ahead.num_seqs, ahead.num_blocks) == (3, 7)
    leave_a()
    leave_a()  # once only
    assert (ahead.num_seqs, ahead.num_blocks) == (2, 6)  # b still holds the prefix
    leave_b()
    assert (ahead.num_seqs, ahead.num_blocks) == (1, 3)
    leave_c()
    assert (ahead.num_seqs, ahead.num_blocks, ahead.num_blocks_with(hashes[0], 3)) == (0, 0, 3)


def test_a_cancel_as_the_turn_comes_is_not_swallowed():
    """On Python 3.11 ``asyncio.wait_for`` returned its result when a cancel landed as
    its wait finished: the sequence went through the gate cancelled (``cancelling()``
    1, no CancelledError) and decoded to its end for a client that had left."""

    async def main() -> tuple[str, int]:
        gate, room = DecodeGate(), [False]

        async def sequence() -> str:
            await gate.enter(lambda: room[0])
            return "through"

        task = asyncio.create_task(sequence())
        await asyncio.sleep(0.05)  # waiting in line
        room[0] = True
        gate.wake()  # room: the head is woken...
        asyncio.get_running_loop().call_soon(task.cancel)  # ...as its client leaves
        try:
            return await task, task.cancelling()
        except asyncio.CancelledError:
            return "cancelled", 0

    outcome, cancelling = asyncio.run(main())
    # Through before the cancel came (it then lands at the caller's next await), or
    # cancelled: never through with the cancel pending and dropped.
    assert outcome == "cancelled" or cancelling == 0, (outcome, cancelling)
