"""One job's recovery: its tier rebuilt from the manifest of its last flush (--recover).

The manifest's chunks are checked against its recorded geometry, reserved in the
swap files and named by the manifest's generation, as if that flush just committed.
"""

from __future__ import annotations

from typing import Any

from offloadd.memory.arena import align_up
from offloadd.memory.shards import Chunk, ShardTable, SwapPlacement
from offloadd.swap.manifests import JobOwner
from offloadd.swap.nvme import READABLE_FORMATS
from offloadd.swap.tier_state import TierState


class TierRecovery(TierState):
    """JobTier's recovery: load_manifest (mixed into ``tier.JobTier``)."""

    def load_manifest(self, table: ShardTable, manifest: dict[str, Any]) -> int:
        dirs = [str(f.dir.path) for f in self.files]
        if manifest["format"] not in READABLE_FORMATS:
            raise ValueError(f"manifest of job {self.job!r} has format {manifest['format']!r}; "
                             f"this offloadd reads formats {list(READABLE_FORMATS)}")
        if manifest["dirs"] != dirs:
            raise ValueError(f"manifest of job {self.job!r} names swap dirs {manifest['dirs']}, "
                             f"daemon has {dirs}; start with the same --swap-dir list")
        bound = manifest["format"] >= 2
        if bound and manifest["owner"] is not None:  # null: a tier that served no hello
            self.recovered_owner = JobOwner.from_record(manifest["owner"])
        gen = int(manifest.get("generation", 1))
        entries = [(entry, [Chunk(*c) for c in entry["chunks"]]) for entry in manifest["shards"]]
        for entry, chunks in entries:
            check_geometry(self.job, entry, chunks, manifest["chunk_nbytes"])
        # New copies keep the geometry the manifest recorded: one chunk size per job.
        self.chunk_nbytes = manifest["chunk_nbytes"]
        placements = []
        for entry, chunks in entries:
            shard = table.create(entry["rank"], entry["id"], entry["nbytes"], entry["dtype"])
            for chunk in chunks:
                self.files[chunk.dir_index].allocator.reserve(chunk.offset, chunk.nbytes)
            if chunks:  # a manifest of an older daemon may list never-written shards
                shard.swap = SwapPlacement(chunks, entry["version"], bound=bound)
                placements.append(shard.swap)
            shard.version = entry["version"]
        self._name_in_gen(gen, placements)
        self.generation = gen
        return len(manifest["shards"])


def check_geometry(job: str, entry: dict[str, Any], chunks: list[Chunk],
                   chunk_nbytes: int) -> None:
    """Refuse a manifest entry whose chunks do not tile its shard in ``chunk_nbytes`` steps."""
    if not chunks:
        return
    arena_nbytes = align_up(max(entry["nbytes"], 1))
    expected = [min(chunk_nbytes, arena_nbytes - start)
                for start in range(0, arena_nbytes, chunk_nbytes)]
    if [c.nbytes for c in chunks] != expected:
        raise ValueError(
            f"manifest of job {job!r}: shard {entry['id']!r} has chunks of "
            f"{[c.nbytes for c in chunks][:4]} bytes, not the {chunk_nbytes}-byte geometry the "
            "manifest records; the manifest is corrupt, restore it or reclaim the job with "
            "`offloadd gc`")
