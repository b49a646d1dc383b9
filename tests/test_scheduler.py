"""Unit tests of the swap scheduler (offloadd.swap.scheduler): no daemon, no files.

- ``IOQueue``: demand before prefetch before write-back, FIFO within a priority,
  never more than ``depth`` in flight, a cancelled waiter leaks no slot.
- ``AccessTrace``: next-use predictions and the upcoming window on a synthetic,
  hand-timed step (explicit ``now`` values, so nothing depends on the clock).
- ``pick_victims``: clean before dirty, furthest next use first, LRU when no trace
  knows the shards, and ``not_before_s`` protects shards needed sooner.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from offloadd.memory.shards import Residency, Shard
from offloadd.memory.trace import OVERDUE_ENTRIES, AccessTrace, pick_victims
from offloadd.swap.scheduler import IOQueue, Priority

MIB = 1 << 20
RunAsync = Callable[[Awaitable[Any]], Any]


def make_shard(name: str, nbytes: int = MIB, *, dirty: bool = False, last_use: int = 0) -> Shard:
    residency = Residency.ARENA_DIRTY if dirty else Residency.ARENA_CLEAN
    return Shard(0, name, nbytes, "uint8", residency=residency, offset=0, last_use=last_use)


# -- IOQueue ----------------------------------------------------------------------


async def admit_order(queue: IOQueue, priorities: list[Priority]) -> list[tuple[int, Priority]]:
    """Fill the queue, enqueue ``priorities`` in order, then drain one slot at a time."""
    order: list[tuple[int, Priority]] = []

    async def worker(index: int, priority: Priority) -> None:
        await queue.enter(priority)
        order.append((index, priority))

    for _ in range(queue.depth):
        await queue.enter(Priority.DEMAND)  # hold every slot
    tasks = [asyncio.ensure_future(worker(i, prio)) for i, prio in enumerate(priorities)]
    await asyncio.sleep(0)
    assert order == [] and queue.in_flight == queue.depth
    for _ in range(len(priorities) + queue.depth):
        queue.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_io_queue_admits_demand_then_prefetch_then_writeback(run_async: RunAsync) -> None:
    priorities = [Priority.WRITEBACK, Priority.PREFETCH, Priority.WRITEBACK, Priority.DEMAND,
                  Priority.PREFETCH, Priority.DEMAND]
    order = run_async(admit_order(IOQueue(1), priorities))
    assert [prio for _i, prio in order] == sorted(priorities)
    # FIFO within one priority: the earlier request of each class goes first
    assert [i for i, _p in order] == [3, 5, 1, 4, 0, 2]


def test_io_queue_never_exceeds_its_depth(run_async: RunAsync) -> None:
    async def scenario() -> list[int]:
        queue = IOQueue(3)
        peak: list[int] = []

        async def request(priority: Priority) -> None:
            await queue.enter(priority)
            peak.append(queue.in_flight)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            queue.leave()

        await asyncio.gather(*(request(Priority(i % 3)) for i in range(20)))
        assert queue.in_flight == 0
        return peak

    peak = run_async(scenario())
    assert len(peak) == 20
    assert max(peak) == 3


def test_io_queue_cancelled_waiter_leaks_no_slot(run_async: RunAsync) -> None:
    async def scenario() -> int:
        queue = IOQueue(1)
        await queue.enter(Priority.DEMAND)
        waiter = asyncio.ensure_future(queue.enter(Priority.PREFETCH))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        queue.leave()
        await asyncio.wait_for(queue.enter(Priority.WRITEBACK), 5)  # the slot is free again
        queue.leave()
        return queue.in_flight

    assert run_async(scenario()) == 0


# -- AccessTrace --------------------------------------------------------------------


def trained_trace(shards: list[Shard], gap_s: float = 1.0) -> AccessTrace:
    """A trace that saw ``shards`` used every ``gap_s`` seconds over one step at t=0.

    Step 1 covers t = 0 .. len*gap; step 2 begins right after it, at t = len*gap.
    """
    trace = AccessTrace()
    trace.begin_step(now=0.0)
    for index, shard in enumerate(shards):
        trace.record(shard, now=index * gap_s)
    trace.begin_step(now=len(shards) * gap_s)
    return trace


def test_access_trace_is_unknown_until_a_step_completed() -> None:
    trace = AccessTrace()
    trace.begin_step(now=0.0)
    shard = make_shard("a")
    trace.record(shard, now=0.5)
    assert not trace.known
    assert math.isinf(trace.next_use_s(shard))
    trace.begin_step(now=1.0)
    assert trace.known


def test_access_trace_next_use_follows_the_previous_step() -> None:
    a, b, c, d = (make_shard(n) for n in "abcd")
    trace = trained_trace([a, b, c, d])  # a@0 b@1 c@2 d@3, step length 4 s
    step2 = 4.0
    trace.record(a, now=step2 + 0.0)  # the rank is at a: the cursor moves past it
    assert trace.next_use_s(b) == pytest.approx(1.0)
    assert trace.next_use_s(c) == pytest.approx(2.0)
    assert trace.next_use_s(d) == pytest.approx(3.0)
    assert trace.next_use_s(a) == pytest.approx(4.0)  # a again: only in the next step
    assert math.isinf(trace.next_use_s(make_shard("never-seen")))
    trace.record(b, now=step2 + 1.0)
    trace.record(c, now=step2 + 2.0)
    assert trace.next_use_s(d) == pytest.approx(1.0)
    assert trace.next_use_s(a) == pytest.approx(2.0)
    assert trace.next_use_s(b) == pytest.approx(3.0)


def test_access_trace_expects_a_passed_shard_not_yet_used_this_step() -> None:
    """A queued optimizer step's state (``state``) was used between two parameter reads
    last step; this step the rank reads on past it before the step is queued. Until it is
    used (or the cursor is ``OVERDUE_ENTRIES`` past it) it is overdue, needed now, not
    idle until the next step: as the furthest next use it was evicted just before its
    step read it."""
    params = [make_shard(f"p{i}") for i in range(OVERDUE_ENTRIES + 4)]
    state = make_shard("state")
    trace = trained_trace([params[0], state, *params[1:]])  # state@1, step 37 s
    step2 = OVERDUE_ENTRIES + 5.0
    for index in range(3):
        trace.record(params[index], now=step2 + index)  # the cursor passes state's place
    assert trace.next_use_s(state) <= 0.0
    assert trace.next_use_s(params[3]) == pytest.approx(1.0)
    trace.record(state, now=step2 + 3.0)  # the step got to it: next use is a step away
    assert trace.next_use_s(state) == pytest.approx(step2 - 2.0)
    for index in range(3, len(params)):
        trace.record(params[index], now=step2 + index + 1)

    trace.begin_step(now=2 * step2)  # the same again, but the state is never used
    (place,) = trace.positions["state"]
    overdue = []
    for index in range(len(params)):
        trace.record(params[index], now=2 * step2 + index)
        if trace.cursor > place:  # passed: overdue until OVERDUE_ENTRIES past it
            overdue.append((trace.next_use_s(state) <= 0.0,
                            trace.cursor <= place + OVERDUE_ENTRIES))
    assert all(got == want for got, want in overdue), overdue
    assert {want for _got, want in overdue} == {True, False}


def test_access_trace_counts_repeated_uses_within_a_step() -> None:
    a, b = make_shard("a"), make_shard("b")
    trace = trained_trace([a, b, a, b])  # a@0 b@1 a@2 b@3
    trace.record(a, now=4.0)
    trace.record(b, now=5.0)
    assert trace.next_use_s(a) == pytest.approx(1.0)  # the second use of a in the step
    trace.record(a, now=6.0)
    assert trace.next_use_s(a) == pytest.approx(2.0)  # first use of a in the next step


def test_access_trace_upcoming_respects_horizon_window_and_wraps() -> None:
    shards = [make_shard(n) for n in "abcdef"]
    trace = trained_trace(shards)  # a@0 .. f@5, step 6 s
    trace.record(shards[0], now=6.0)  # at a
    ahead = [(s.shard_id, due) for s, due in trace.upcoming(100 * MIB, horizon_s=2.5)]
    assert [n for n, _ in ahead] == ["b", "c"]
    assert [due for _, due in ahead] == pytest.approx([1.0, 2.0])
    window = [s.shard_id for s, _ in trace.upcoming(3 * MIB, horizon_s=100.0)]
    assert window == ["b", "c", "d"]
    for shard, now in zip(shards[1:5], (7.0, 8.0, 9.0, 10.0)):
        trace.record(shard, now=now)  # at e
    wrapped = [(s.shard_id, due) for s, due in trace.upcoming(100 * MIB, horizon_s=3.5)]
    assert [n for n, _ in wrapped] == ["f", "a", "b"]  # into the next step
    assert [due for _, due in wrapped] == pytest.approx([1.0, 2.0, 3.0])


def test_access_trace_ignores_a_shard_off_the_learned_order() -> None:
    a, b, c = make_shard("a"), make_shard("b"), make_shard("c")
    trace = trained_trace([a, b, c])
    trace.record(a, now=3.0)
    trace.record(make_shard("stray"), now=3.5)  # unknown: the cursor stays at a
    assert [s.shard_id for s, _ in trace.upcoming(100 * MIB, 10.0)][:2] == ["b", "c"]


# -- pick_victims ------------------------------------------------------------------


def ids(shards: list[Shard]) -> list[str]:
    return [s.shard_id for s in shards]


def test_pick_victims_clean_before_dirty() -> None:
    dirty_far = make_shard("dirty-far", dirty=True)
    clean_near = make_shard("clean-near")
    chosen = pick_victims([(dirty_far, 100.0), (clean_near, 1.0)], MIB)
    assert ids(chosen) == ["clean-near"]
    both = pick_victims([(dirty_far, 100.0), (clean_near, 1.0)], 2 * MIB)
    assert ids(both) == ["clean-near", "dirty-far"]


def test_pick_victims_furthest_next_use_first() -> None:
    candidates = [(make_shard(f"s{i}"), float(t)) for i, t in enumerate([5, 50, math.inf, 1])]
    chosen = pick_victims(candidates, 3 * MIB)
    assert ids(chosen) == ["s2", "s1", "s0"]  # never used again, then the latest uses


def test_pick_victims_falls_back_to_lru_without_a_trace() -> None:
    shards = [make_shard(f"s{i}", last_use=use) for i, use in enumerate([30, 10, 20, 40])]
    chosen = pick_victims([(s, math.inf) for s in shards], 2 * MIB)
    assert ids(chosen) == ["s1", "s2"]


def test_pick_victims_takes_just_enough_bytes() -> None:
    shards = [make_shard(f"s{i}", nbytes=(i + 1) * MIB, last_use=i) for i in range(4)]
    chosen = pick_victims([(s, math.inf) for s in shards], 3 * MIB)
    assert ids(chosen) == ["s0", "s1"]  # 1 + 2 MiB; stops as soon as the need is met
    assert pick_victims([(s, math.inf) for s in shards], 0) == []


def test_pick_victims_never_evicts_what_is_needed_before_the_prefetch() -> None:
    soon, later = make_shard("soon"), make_shard("later")
    candidates = [(soon, 1.0), (later, 10.0)]
    assert ids(pick_victims(candidates, 2 * MIB, not_before_s=5.0)) == ["later"]
    assert pick_victims(candidates, MIB, not_before_s=20.0) == []
    assert ids(pick_victims(candidates, 2 * MIB)) == ["later", "soon"]


def test_access_trace_knows_a_re_created_shard_by_its_id() -> None:
    a, b = make_shard("a"), make_shard("b")
    trace = trained_trace([a, b])  # a@0 b@1, step 2 s
    trace.record(a, now=2.0)
    b_again = make_shard("b")  # dropped and re-created: a new object, the same shard
    assert trace.next_use_s(b_again) == pytest.approx(1.0)


def test_access_trace_cursor_ignores_one_far_out_of_place_access() -> None:
    shards = [make_shard(f"s{i}") for i in range(40)]
    trace = trained_trace(shards)  # s0@0 .. s39@39, step 40 s
    trace.record(shards[0], now=40.0)
    trace.record(shards[39], now=40.1)  # e.g. an async step landing early this time
    assert trace.next_use_s(shards[1]) == pytest.approx(1.0)  # the cursor stayed at s0
