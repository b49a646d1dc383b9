"""The daemon stages shards ahead of use from each rank's learned stage_in trace
(offloadd.service.device_copies read-ahead, trainer.offload.daemon_copies) on the CPU twin.

A real daemon process copies into read-ahead slots the rank lent it at
staging_open; raw clients check the protocol (hit, miss, stale, slot reuse only
after slot_done, leases and pins back after a disconnect), and two gloo ranks
train stage 3 through it against plain torch.
"""

from __future__ import annotations

import os
import time

import pytest
from test_daemon_metrics import scrape, value
from test_device_copies import TwinSlots

from offloadd import protocol as p
from offloadd.errors import InvalidRequestError, LeaseConflictError, SlotBusyError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

pytestmark = pytest.mark.usefixtures("strict_device_twin")

READAHEAD = "offloadd_device_copies_readahead_total"
SLOTS, LENT = 4, 2  # slots 0, 1 are the rank's; 2, 3 the daemon's read-ahead slots
NBYTES = 512


def _open(connect, staging: TwinSlots, **fields: object) -> OffloadClient:
    client = connect(**fields)
    reply = client.request(staging.open_request(num_slots=SLOTS, readahead_slots=LENT))
    assert isinstance(reply, p.StagingOk)
    assert (reply.path, reply.readahead_slots) == ("daemon", LENT)
    return client


def _read(client: OffloadClient, staging: TwinSlots, shard_id: str, nbytes: int = NBYTES,
          done: bool = True) -> tuple[p.Staged, bytes]:
    """One stage_in into the rank's slot 0; the bytes come from the slot the reply names."""
    reply = staging.stage_in(client, shard_id, 0)
    assert reply.slot == 0 or reply.slot >= SLOTS - LENT
    data = staging.slot(reply.slot, nbytes)
    if done:
        staging.slot_done(client, reply.slot)
    return reply, data


def _learn(client: OffloadClient, staging: TwinSlots, ids: list[str]) -> None:
    """One step of stage_ins: the daemon learns the order."""
    client.step_begin()
    for shard_id in ids:
        assert _read(client, staging, shard_id)[0].outcome == "miss"
    client.step_begin()


def _settled(daemon: PrivateDaemon, name: str, **labels: str) -> float:
    """A counter once the copies issued so far are in it: the daemon counts a copy on its loop
    after the copy's event is recorded, so a scrape right after "filled" can miss it."""
    last = value(scrape(daemon), name, **labels)
    while True:
        time.sleep(0.05)
        now = value(scrape(daemon), name, **labels)
        if now == last:
            return now
        last = now


@pytest.fixture
def staging() -> TwinSlots:
    slots = TwinSlots(num_slots=SLOTS, slot_nbytes=NBYTES)
    yield slots
    slots.close()


def test_second_step_is_served_from_read_ahead(daemon: PrivateDaemon, connect,
                                               staging: TwinSlots) -> None:
    before = scrape(daemon)
    client = _open(connect, staging)
    values = {f"u{i}": os.urandom(NBYTES) for i in range(6)}
    client.put_many(values)
    order = [*values, *reversed(values)]  # a forward and a backward pass, as stage 3 reads
    _learn(client, staging, order)
    for _round in range(2):
        for shard_id in order:
            reply, data = _read(client, staging, shard_id)
            assert data == values[shard_id]
            assert (reply.outcome, reply.version) == ("hit", 1), (shard_id, reply)
            assert reply.slot >= SLOTS - LENT
        client.step_begin()
    after = scrape(daemon)
    for outcome, count in (("miss", len(order)), ("hit", 2 * len(order)), ("stale", 0)):
        assert value(after, READAHEAD, outcome=outcome) == \
            value(before, READAHEAD, outcome=outcome) + count, outcome


def test_shard_written_after_staged_ahead_is_copied_again(daemon: PrivateDaemon, connect,
                                                          staging: TwinSlots) -> None:
    """A put (acquire w, release dirty) and a stage_out after the read-ahead copy: the next
    stage_in re-copies (stale) and the rank sees the new bytes, never the staged ones."""
    before = value(scrape(daemon), READAHEAD, outcome="stale")
    client = _open(connect, staging)
    client.put_many({"a": b"a" * NBYTES, "b": b"b" * NBYTES, "c": b"c" * NBYTES})
    _learn(client, staging, ["a", "b", "c"])  # step_begin staged a and b ahead
    client.put("a", b"A" * NBYTES)
    staging.stage_out(client, "b", 1, b"B" * NBYTES)
    first, data = _read(client, staging, "a")
    assert (first.outcome, first.version, data) == ("stale", 2, b"A" * NBYTES)
    second, data = _read(client, staging, "b")
    # The read of a can let the read-ahead copy b's new version before b is read (a
    # loaded CI run saw it): a hit then, of version 2, never of the staged bytes.
    assert second.outcome in ("stale", "hit")
    assert (second.version, data) == (2, b"B" * NBYTES)
    third, data = _read(client, staging, "c")
    assert (third.outcome, data) == ("hit", b"c" * NBYTES)
    stale = 1 + (second.outcome == "stale")
    assert value(scrape(daemon), READAHEAD, outcome="stale") == before + stale


def test_read_ahead_slot_reused_only_after_slot_done(connect, staging: TwinSlots) -> None:
    """A hit hands the rank a read-ahead slot: the daemon fills it again only after the
    rank's slot_done, and the twin refuses a second slot_done or a rank copy into it."""
    client = _open(connect, staging)
    values = {name: name.encode() * NBYTES for name in "abcd"}
    client.put_many({name: data[:NBYTES] for name, data in values.items()})
    _learn(client, staging, list(values))
    held, _ = _read(client, staging, "a", done=False)  # the rank still reads this slot
    assert held.outcome == "hit"
    for _round in range(2):  # the daemon stages the rest around the held slot
        for name in "bcd":
            reply, data = _read(client, staging, name)
            assert reply.slot != held.slot
            assert data == values[name][:NBYTES]
        client.step_begin()
        assert staging.slot(held.slot, NBYTES) == values["a"][:NBYTES]  # never overwritten
    with pytest.raises(InvalidRequestError, match="lent to the daemon"):
        client.request(p.StageIn(0, "b", held.slot))
    with pytest.raises(InvalidRequestError, match="lent to the daemon"):
        client.request(p.StageOut(0, "b", held.slot, NBYTES))
    staging.slot_done(client, held.slot)
    with pytest.raises(SlotBusyError, match="consumer event"):
        client.request(p.SlotDone(0, held.slot))


def test_read_ahead_skips_shards_the_rank_holds_staged(daemon: PrivateDaemon, connect) -> None:
    """Bytes the rank staged itself (its own prefetch) and has not reported consumed are on
    its GPU: the read-ahead slot goes to the next shard instead of a second copy of them."""
    copied = "offloadd_device_copies_bytes_total"
    staging = TwinSlots(num_slots=SLOTS, slot_nbytes=NBYTES)  # slot 3 lent
    try:
        client = connect()
        reply = client.request(staging.open_request(num_slots=SLOTS, readahead_slots=1))
        assert isinstance(reply, p.StagingOk) and reply.readahead_slots == 1
        values = {name: name.encode() * NBYTES for name in "xay"}
        client.put_many(values)
        _learn(client, staging, ["x", "a", "a", "y"])  # "a" is read twice in a row
        assert staging.stage_in(client, "x", 0).outcome == "hit"  # from slot 3, held
        assert staging.stage_in(client, "a", 1).slot == 1  # the rank's prefetch, held
        before = _settled(daemon, copied, direction="h2d")
        staging.slot_done(client, 3)  # next in the trace: "a" (held by the rank), then "y"
        reply = staging.stage_in(client, "y", 0)
        assert (reply.outcome, staging.slot(reply.slot, NBYTES)) == ("hit", values["y"])
        assert _settled(daemon, copied, direction="h2d") == before + NBYTES  # y only
    finally:
        staging.close()


def test_readahead_slots_must_leave_the_rank_a_slot(connect, staging: TwinSlots) -> None:
    client = connect()
    for lent in (SLOTS, -1):
        with pytest.raises(InvalidRequestError, match="readahead_slots"):
            client.request(staging.open_request(num_slots=SLOTS, readahead_slots=lent))
    reply = client.request(staging.open_request(num_slots=SLOTS))  # none lent: as before
    assert isinstance(reply, p.StagingOk) and reply.readahead_slots == 0
    client.put("x", b"x" * 8)
    reply = staging.stage_in(client, "x", 3)
    assert (reply.slot, reply.outcome) == (3, "")


def test_disconnect_with_read_ahead_in_flight_leaks_no_lease_or_pin(
        monkeypatch, tmp_path) -> None:
    """The rank goes away while the daemon's read-ahead copies run (a twin of up to 0.2 s a
    copy): they finish, their pins go back (the shards can be dropped) and no lease is left."""
    from conftest import start_daemon

    from offloadd.gpu.cuda import TWIN_MAX_DELAY_ENV

    monkeypatch.setenv(TWIN_MAX_DELAY_ENV, "200000")
    daemon = start_daemon(tmp_path)
    staging = TwinSlots(num_slots=SLOTS, slot_nbytes=NBYTES)
    try:
        def connect() -> OffloadClient:
            return OffloadClient.connect(daemon.socket_path, job="gone", arena_nbytes=1 << 20,
                                         timeout_s=10)

        client = _open(connect, staging)
        ids = [f"s{i}" for i in range(4)]
        client.put_many({shard_id: bytes([i]) * NBYTES for i, shard_id in enumerate(ids)})
        _learn(client, staging, ids)  # its last step_begin starts two read-ahead copies
        client.request_async(p.StageIn(0, ids[0], 0))  # claims one copy still running
        client.close()
        again = connect()
        for _ in range(10_000):  # waits for pins; a claimed copy in flight holds a read lease
            try:
                again.request(p.Drop(0, ids))  # one pin left behind would hang here
                break
            except LeaseConflictError:
                time.sleep(0.001)
        else:
            raise AssertionError("the claimed copy's lease never came back")
        stats = again.stats()
        assert stats["leased_nbytes"] == 0 and stats["num_shards"] == 0, stats
        again.close()
        with open(daemon.log_path) as log:
            text = log.read()
        assert "never retrieved" not in text and "readahead_failed" not in text
    finally:
        staging.close()
        assert daemon.stop() == 0


# ---------------------------------------------------------------------------
# stage 3 training with the daemon's read-ahead (2 gloo ranks, one real daemon)


def _train_readahead(rank: int, world: int, device: str, config: dict) -> object:
    import tempfile

    from _dist import make_batch, make_model, shared_daemon

    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    swap_dir = tempfile.mkdtemp(prefix="offloadd-swap-") if device == "nvme" else None
    config = {**config, "offloadd": {"job": f"ra{device}",
                                     "arena_size": 16 << 20, "device_copies": "daemon",
                                     "staging_slots": 4, "staging_readahead_slots": 2}}
    if swap_dir:
        for section in config["zero_optimization"].values():
            if isinstance(section, dict):
                section["nvme_path"] = swap_dir
    with shared_daemon(rank, swap_dir, arena_size=256 << 20) as socket_path:
        config["offloadd"]["socket"] = socket_path
        model = make_model(0)
        engine, _, _, _ = trainer.initialize(model=model, model_parameters=model.parameters(),
                                             config=config)
        try:
            firsts = []
            for step in range(STEPS):
                for micro in range(engine.gradient_accumulation_steps()):
                    batch = make_batch(step, micro, rank,
                                       engine.train_micro_batch_size_per_gpu())
                    loss = engine(*(t.to(engine.collectives.device) for t in batch))
                    engine.backward(loss)
                    engine.step()
                if step == 0:
                    firsts = engine.offload_stats()
            stats = engine.offload_stats()
            return consolidate_fp32_state_dict(engine), firsts, stats
        finally:
            engine.close()


STEPS = 5


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_stage3_reads_are_mostly_served_from_read_ahead(device: str) -> None:
    """After the first step most stage-3 parameter stage_ins hit the daemon's read-ahead,
    and training still matches plain torch."""
    from _dist import base_config, max_relative_error, reference_train, run_ranks

    zero = {"stage": 3, "offload_optimizer": {"device": device},
            "offload_param": {"device": device}}
    config = base_config(zero_optimization=zero)
    results = run_ranks(_train_readahead, 2, device, config, timeout_s=90)
    reference = reference_train(config, STEPS, 2)
    assert max_relative_error(results[0][0], reference) < 1e-5
    for _state, first, stats in results:
        assert stats["rank_device_copies"] == "daemon"
        later = {outcome: stats[f"rank_readahead_{outcome}"] - first[f"rank_readahead_{outcome}"]
                 for outcome in ("hit", "miss", "stale")}
        assert first["rank_readahead_hit"] == 0  # nothing learned yet
        assert later["hit"] > later["miss"] + later["stale"], later
