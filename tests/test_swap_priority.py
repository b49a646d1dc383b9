"""A demand read waiting behind a write-back raises that write-back at the IO gate."""

from __future__ import annotations

import asyncio

from offloadd.swap.scheduler import IOQueue, IOTicket, Priority


def test_a_raised_ticket_is_admitted_ahead_of_prefetches_and_other_write_backs(run_async) -> None:
    async def scenario() -> list[str]:
        gate = IOQueue(depth=1)
        await gate.enter(Priority.DEMAND)  # the drive is busy: everything below waits
        ticket = IOTicket(Priority.WRITEBACK)
        admitted: list[str] = []

        async def request(name: str, priority: Priority, with_ticket: IOTicket | None = None
                          ) -> None:
            await gate.enter(priority, with_ticket)
            admitted.append(name)
            gate.leave()

        tasks = [asyncio.ensure_future(request("other-write-back", Priority.WRITEBACK)),
                 asyncio.ensure_future(request("prefetch", Priority.PREFETCH)),
                 asyncio.ensure_future(request("waited-on-write-back", Priority.WRITEBACK,
                                               ticket))]
        await asyncio.sleep(0)
        ticket.priority = Priority.DEMAND
        gate.raise_priority(ticket, Priority.DEMAND)  # a demand read waits for this shard
        gate.leave()
        await asyncio.gather(*tasks)
        return admitted

    assert run_async(scenario()) == ["waited-on-write-back", "prefetch", "other-write-back"]
