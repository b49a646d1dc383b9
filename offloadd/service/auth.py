"""Per-job authorization: a job belongs to the uid that created it.

The node allowlist (``allowed_uids``, checked at connect) says who may talk to
the daemon at all; this module says who may attach to which job. The first
hello of a job records the peer's uid (SO_PEERCRED, which the kernel fills in
and a client cannot forge) and, optionally, a job secret; every later hello
for that job must come from the same uid (root excepted) and present the same
secret. ``node_status`` shows a uid only its own jobs.

What this does not protect against (see deploy/README.md): root, and any
container whose processes map to uid 0 on the host, can attach to every job,
read every arena through /proc, and see every job in ``node_status``. The job
secret still binds root's hellos, but root can read it from the ranks'
environment.

The other direction, a client checking who listens on the socket before it sends its
secret, is ``offloadd.protocol.check_daemon_peer`` (clients import only the protocol).

Ownership outlives the daemon: every flush manifest records the owner (``record``),
the secret only as a salted HMAC-SHA256, and ``--recover`` restores it (``restore``),
so after a restart the job still belongs to the uid that created it. The record itself,
``JobOwner``, lives with the manifests that store it (``offloadd.swap.manifests``).
"""

from __future__ import annotations

from typing import Any

from offloadd.errors import PermissionDeniedError
from offloadd.protocol import JOB_SECRET_ENV, ROOT_UID
from offloadd.swap.manifests import JobOwner


class JobAuthority:
    """The owner of every job on the node; checks each hello against it."""

    def __init__(self, *, require_job_secret: bool = False) -> None:
        self.require_job_secret = require_job_secret
        self.owners: dict[str, JobOwner] = {}

    def check_hello(self, job: str, uid: int, secret: str) -> None:
        """Raise PermissionDeniedError unless ``uid`` with ``secret`` may attach to ``job``."""
        if self.require_job_secret and not secret:
            raise PermissionDeniedError(
                f"this daemon requires a job secret (require_job_secret); set "
                f"{JOB_SECRET_ENV} for every rank of job {job!r}")
        owner = self.owners.get(job)
        if owner is None:
            return
        if uid != owner.uid and uid != ROOT_UID:
            raise PermissionDeniedError(
                f"job {job!r} belongs to uid {owner.uid}; uid {uid} may not attach to it "
                "(pick another job name)")
        if not owner.secret_matches(secret):
            raise PermissionDeniedError(
                f"wrong or missing job secret for job {job!r}; every rank must present the "
                f"secret of the rank that created the job ({JOB_SECRET_ENV})")

    def claim(self, job: str, uid: int, secret: str) -> None:
        """Record the creator of a job (first successful hello); later hellos keep it."""
        if job not in self.owners:
            self.owners[job] = JobOwner.create(uid, secret)

    def record(self, job: str) -> dict[str, Any] | None:
        """The owner of ``job`` as its flush manifest stores it (None: not claimed yet)."""
        owner = self.owners.get(job)
        return owner.record() if owner is not None else None

    def restore(self, job: str, owner: JobOwner | None) -> None:
        """At ``--recover``: the owner its manifest recorded. A manifest of an older daemon
        names none: its job is then root's, since no uid can prove it created it."""
        self.owners[job] = owner if owner is not None else JobOwner.create(ROOT_UID, "")

    def forget(self, job: str) -> None:
        self.owners.pop(job, None)

    def visible(self, job: str, uid: int) -> bool:
        """Whether ``uid`` may see ``job`` in node_status (its own jobs; root sees all)."""
        owner = self.owners.get(job)
        return uid == ROOT_UID or (owner is not None and owner.uid == uid)

    def scope(self, uid: int) -> str:
        """'all' when node_status shows every job to ``uid``, else 'own'."""
        return "all" if uid == ROOT_UID else "own"

