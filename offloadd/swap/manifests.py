"""Reading flush manifests at recovery: two generations, and quarantine of a bad job.

A manifest also says whether its job was live or had ended: a flush writes it with no
``ended_at`` (live), and a job that ends with its files kept has both generations
rewritten with ``ended_at`` (``mark_ended``). ``--recover`` brings back only live jobs;
an ended one stays files until its owner (the manifest's ``owner``) claims it or its
retention runs out (``offloadd.swap.retention``).

A flush replaces ``manifest.json`` atomically; just before, the manifest it
replaces is hard-linked as ``manifest.prev.json``, so a newest manifest that
is torn or corrupt on disk (a bad block, a copy gone wrong) still recovers
the generation before it. A manifest that parses but does not fit this
daemon (another swap-dir list, a replaced drive) quarantines its job: the
daemon starts and the other jobs recover, while a hello for the quarantined
one gets a typed error saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offloadd.swap.swapdirs import FILE_FLAGS, open_private_subdir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREVIOUS = "manifest.prev.json"
REQUIRED_KEYS = ("format", "job", "arena_nbytes", "dirs", "shards", "tag")
ENDED_AT = "ended_at"
"""Unix time the job ended at; absent (or null): the job was live when it last flushed."""


# -- the owner record (a job's uid and secret digest, restored at --recover) ---------

SALT_NBYTES = 16
DIGEST_NBYTES = 32


def _secret_digest(salt: bytes, secret: str) -> bytes:
    return hmac.new(salt, secret.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class JobOwner:
    """Who created a job: their uid, and the secret every rank must present ('' = none),
    kept only as a salted digest (it is written to manifests)."""

    uid: int
    salt: bytes
    secret_digest: bytes

    @classmethod
    def create(cls, uid: int, secret: str) -> JobOwner:
        salt = os.urandom(SALT_NBYTES)
        return cls(uid, salt, _secret_digest(salt, secret))

    def secret_matches(self, secret: str) -> bool:
        return hmac.compare_digest(_secret_digest(self.salt, secret), self.secret_digest)

    def record(self) -> dict[str, Any]:
        """The owner as a manifest stores it."""
        return {"uid": self.uid, "salt": self.salt.hex(),
                "secret_hmac_sha256": self.secret_digest.hex()}

    @classmethod
    def from_record(cls, record: Any) -> JobOwner:
        """Parse ``record()``'s output; ValueError naming what is wrong."""
        if not isinstance(record, dict) or set(record) != {"uid", "salt", "secret_hmac_sha256"}:
            raise ValueError(f"the owner record {str(record)[:200]!r} is malformed")
        uid, salt, digest = record["uid"], record["salt"], record["secret_hmac_sha256"]
        if not isinstance(uid, int) or isinstance(uid, bool) or not 0 <= uid < 2**32:
            raise ValueError(f"the owner record names no uid: {uid!r}")
        try:
            owner = cls(uid, bytes.fromhex(salt), bytes.fromhex(digest))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the owner record's salt or digest is not hex: {exc}") from exc
        if len(owner.salt) != SALT_NBYTES or len(owner.secret_digest) != DIGEST_NBYTES:
            raise ValueError("the owner record's salt or digest has the wrong length")
        return owner


class ManifestError(ValueError):
    """A manifest that cannot be read or does not fit this daemon."""


def keep_previous_generation(dir_fd: int) -> None:
    """Hard-link the current manifest as the previous generation (before a new one replaces it).

    The link is made under a temp name and renamed, so ``manifest.prev.json`` is
    always one whole earlier manifest; the directory fsync of the write that follows
    makes it durable together with the new one. Names are relative to the job's
    checked dir fd (``offloadd.swap.swapdirs``), and no symlink is followed.
    """
    try:
        os.stat(MANIFEST, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    staging = PREVIOUS + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging, dir_fd=dir_fd)
    os.link(MANIFEST, staging, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    os.replace(staging, PREVIOUS, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _staged_name(name: str) -> str:
    return Path(name).with_suffix(".tmp").name


def stage_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write and fsync ``name``'s temp file; ``name`` itself is untouched (then
    ``publish_staged``: the old or the new file, never half).

    The temp file is made anew (O_EXCL | O_NOFOLLOW) relative to the checked dir fd: a
    symlink planted at its name is removed, never written through.
    """
    tmp = _staged_name(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def discard_staged(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_staged_name(name), dir_fd=dir_fd)


def publish_staged(dir_fd: int, name: str) -> None:
    """Rename the staged temp file over ``name`` and fsync the directory."""
    os.replace(_staged_name(name), name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _read_file(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def parse_manifest(dir_fd: int, path: Path, job: str) -> dict[str, Any]:
    try:
        manifest = json.loads(_read_file(dir_fd, path.name))
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path} is unreadable or torn: {exc}") from exc
    if not isinstance(manifest, dict) or any(key not in manifest for key in REQUIRED_KEYS):
        raise ManifestError(f"{path} lacks the keys {list(REQUIRED_KEYS)}")
    if manifest["job"] != job:
        raise ManifestError(f"{path} names job {manifest['job']!r}, not its folder's {job!r}")
    return manifest


def read_job_manifest(job_dir: Path, root_fd: int) -> dict[str, Any]:
    """The newest whole manifest of a job: ``manifest.json``, else the generation before.
    The job's dir must be private to the daemon (``offloadd.swap.swapdirs``): another uid's dir
    would let that uid choose what is restored."""
    dir_fd = open_private_subdir(root_fd, job_dir.name, job_dir, create=False)
    try:
        return _read_generations(dir_fd, job_dir)
    finally:
        os.close(dir_fd)


def _read_generations(dir_fd: int, job_dir: Path) -> dict[str, Any]:
    job = job_dir.name
    try:
        return parse_manifest(dir_fd, job_dir / MANIFEST, job)
    except ManifestError as newest_error:
        previous = job_dir / PREVIOUS
        if not previous.exists():
            raise
        try:
            manifest = parse_manifest(dir_fd, previous, job)
        except ManifestError as exc:
            raise ManifestError(f"{newest_error}; the previous generation too: {exc}") from exc
        log.warning("event=manifest_fallback job=%s error=%r using=%s", job, str(newest_error),
                    PREVIOUS)
        return manifest


def has_manifest(job_dir: Path) -> bool:
    """Whether a job folder holds a manifest of either generation."""
    return (job_dir.is_dir() and not job_dir.is_symlink()
            and ((job_dir / MANIFEST).exists() or (job_dir / PREVIOUS).exists()))


def jobs_with_manifests(root: Path) -> list[Path]:
    """Job folders in a swap dir's layout dir holding a manifest of either generation."""
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if has_manifest(p))


# -- live or ended, and what the swap files must keep ---------------------------------


def manifest_ended_at(manifest: dict[str, Any]) -> float | None:
    """When the manifest's job ended (None: it was live); ManifestError if malformed."""
    ended_at = manifest.get(ENDED_AT)
    if ended_at is None:
        return None
    if (not isinstance(ended_at, int | float) or isinstance(ended_at, bool)
            or not math.isfinite(ended_at)):
        raise ManifestError(f"manifest of job {manifest.get('job')!r}: {ENDED_AT} is "
                            f"{ended_at!r}, not a time")
    return float(ended_at)


def manifest_owner(manifest: dict[str, Any]) -> JobOwner | None:
    """The owner the manifest records (None: a format-1 manifest, or a job no hello served)."""
    record = manifest.get("owner")
    if manifest.get("format", 1) < 2 or record is None:
        return None
    try:
        return JobOwner.from_record(record)
    except ValueError as exc:
        raise ManifestError(f"manifest of job {manifest.get('job')!r}: {exc}") from exc


def manifest_flushed_at(manifest: dict[str, Any]) -> float:
    """When the manifest was written (0: not recorded)."""
    created = manifest.get("created")
    if isinstance(created, int | float) and not isinstance(created, bool):
        return float(created) if math.isfinite(created) else 0.0
    return 0.0


def named_file_ends(manifest: dict[str, Any]) -> dict[int, int]:
    """Swap dir index -> end of the furthest extent the manifest names in that dir's file;
    ManifestError if a chunk is malformed."""
    ends: dict[int, int] = {}
    try:
        for entry in manifest["shards"]:
            for chunk in entry["chunks"]:
                dir_index, offset, nbytes = chunk[0], chunk[1], chunk[2]
                if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in (dir_index, offset, nbytes)):
                    raise ManifestError(f"manifest of job {manifest.get('job')!r}: chunk "
                                        f"{str(chunk)[:80]} is malformed")
                ends[dir_index] = max(ends.get(dir_index, 0), offset + nbytes)
    except (KeyError, IndexError, TypeError) as exc:
        raise ManifestError(f"manifest of job {manifest.get('job')!r}: its shard list is "
                            f"malformed ({exc!r})") from exc
    return ends


def mark_ended(job_dir: Path, root_fd: int, ended_at: float | None
               ) -> tuple[dict[str, Any], dict[int, int]]:
    """Record in each readable generation of a job's manifest that the job ended at
    ``ended_at`` (None: that it is live again, claimed by its owner); each file is
    replaced whole, by ``stage_file`` and ``publish_staged``. The caller holds the job's
    commit lock or the job has no tier: no flush writes these files meanwhile.

    Returns the newest manifest and the file ends both generations name (what its swap
    files must keep: the previous generation is recovery's fallback). A torn generation is
    left as it is. ManifestError if neither generation is readable.
    """
    dir_fd = open_private_subdir(root_fd, job_dir.name, job_dir, create=False)
    try:
        newest: dict[str, Any] | None = None
        ends: dict[int, int] = {}
        for name in (PREVIOUS, MANIFEST):  # a crash in between leaves the newest one as it was
            try:
                manifest = parse_manifest(dir_fd, job_dir / name, job_dir.name)
                generation_ends = named_file_ends(manifest)
            except ManifestError:
                continue
            if manifest.get(ENDED_AT) != ended_at:
                manifest[ENDED_AT] = ended_at
                stage_file(dir_fd, name, json.dumps(manifest).encode())
                publish_staged(dir_fd, name)
            newest = manifest
            for index, end in generation_ends.items():
                ends[index] = max(ends.get(index, 0), end)
        if newest is None:
            raise ManifestError(f"no readable manifest in {job_dir}")
        return newest, ends
    finally:
        os.close(dir_fd)


def retained_file_ends(job_dir: Path, root_fd: int) -> dict[int, int]:
    """The file ends either readable generation of a job's manifest names (see mark_ended)."""
    dir_fd = open_private_subdir(root_fd, job_dir.name, job_dir, create=False)
    try:
        ends: dict[int, int] = {}
        for name in (PREVIOUS, MANIFEST):
            try:
                generation_ends = named_file_ends(
                    parse_manifest(dir_fd, job_dir / name, job_dir.name))
            except ManifestError:
                continue
            for index, end in generation_ends.items():
                ends[index] = max(ends.get(index, 0), end)
        return ends
    finally:
        os.close(dir_fd)
