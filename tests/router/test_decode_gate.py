"""The decode gate's line: first come first served, woken one at a time, and a waiter that
is cancelled (its client left) leaves the line without stalling the ones behind it."""

from __future__ import annotations

import asyncio

from router.decode_gate import DecodeGate


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
