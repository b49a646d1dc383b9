"""Reading flush manifests at recovery: two generations, and quarantine of a bad job.

A flush replaces ``manifest.json`` atomically; just before, the manifest it
replaces is hard-linked as ``manifest.prev.json``, so a newest manifest that
is torn or corrupt on disk (a bad block, a copy gone wrong) still recovers
the generation before it. A manifest that parses but does not fit this
daemon (another swap-dir list, a replaced drive) quarantines its job: the
daemon starts and the other jobs recover, while a hello for the quarantined
one gets a typed error saying why.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREVIOUS = "manifest.prev.json"
REQUIRED_KEYS = ("format", "job", "arena_nbytes", "dirs", "shards", "tag")


class ManifestError(ValueError):
    """A manifest that cannot be read or does not fit this daemon."""


def keep_previous_generation(path: Path) -> None:
    """Hard-link the current manifest as the previous generation (before a new one replaces it).

    The link is made under a temp name and renamed, so ``manifest.prev.json`` is
    always one whole earlier manifest; the directory fsync of the write that follows
    makes it durable together with the new one.
    """
    if not path.exists():
        return
    previous = path.with_name(PREVIOUS)
    staging = path.with_name(PREVIOUS + ".tmp")
    staging.unlink(missing_ok=True)
    os.link(path, staging)
    os.replace(staging, previous)


def parse_manifest(path: Path, job: str) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path} is unreadable or torn: {exc}") from exc
    if not isinstance(manifest, dict) or any(key not in manifest for key in REQUIRED_KEYS):
        raise ManifestError(f"{path} lacks the keys {list(REQUIRED_KEYS)}")
    if manifest["job"] != job:
        raise ManifestError(f"{path} names job {manifest['job']!r}, not its folder's {job!r}")
    return manifest


def read_job_manifest(job_dir: Path) -> dict[str, Any]:
    """The newest whole manifest of a job: ``manifest.json``, else the generation before."""
    job = job_dir.name
    try:
        return parse_manifest(job_dir / MANIFEST, job)
    except ManifestError as newest_error:
        previous = job_dir / PREVIOUS
        if not previous.exists():
            raise
        try:
            manifest = parse_manifest(previous, job)
        except ManifestError as exc:
            raise ManifestError(f"{newest_error}; the previous generation too: {exc}") from exc
        log.warning("event=manifest_fallback job=%s error=%r using=%s", job, str(newest_error),
                    PREVIOUS)
        return manifest


def jobs_with_manifests(root: Path) -> list[Path]:
    """Job folders in a swap dir's layout dir holding a manifest of either generation."""
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and ((p / MANIFEST).exists() or (p / PREVIOUS).exists()))
