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

Job names are shown to their owner and root only. ``node_status`` and a job's ``stats``
show another uid's jobs as counts (``num_jobs``), never by name, and a quarantined job
only to its owner. ``/metrics`` is plain HTTP: it cannot tell who scrapes, so its
``train_job`` label is never the name but an opaque label, a keyed hash of the name
(``metrics_label``) with a key of this daemon run: a stranger can neither read a name
off it nor test a guessed name against it. A job's own ``stats`` and its owner's
``node_status`` give the label, so the owner (and root) find their series.

The other direction, a client checking who listens on the socket before it sends its
secret, is ``offloadd.protocol.check_daemon_peer`` (clients import only the protocol).

Ownership outlives the daemon: every flush manifest records the owner (``record``),
the secret only as a salted HMAC-SHA256, and ``--recover`` restores it (``restore``),
so after a restart the job still belongs to the uid that created it. The record itself,
``JobOwner``, lives with the manifests that store it (``offloadd.swap.manifests``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from offloadd.errors import PermissionDeniedError
from offloadd.metrics import JOB_LABEL
from offloadd.protocol import JOB_SECRET_ENV, ROOT_UID
from offloadd.swap.manifests import JobOwner


class JobAuthority:
    """The owner of every job on the node; checks each hello against it."""

    def __init__(self, *, require_job_secret: bool = False) -> None:
        self.require_job_secret = require_job_secret
        self.owners: dict[str, JobOwner] = {}
        self.label_key = secrets.token_bytes(32)
        """Keys ``metrics_label``: new each run, so a label cannot be matched to a guess."""

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

    def metrics_label(self, job: str) -> str:
        """The ``train_job`` label of ``job`` on /metrics: 'j-' and 16 hex digits of an
        HMAC-SHA256 of the name, the same for the name all through this daemon run."""
        digest = hmac.new(self.label_key, job.encode(errors="surrogateescape"), hashlib.sha256)
        return "j-" + digest.hexdigest()[:16]


class _JobLabelMask:
    """A Prometheus collector: another registry's families, each ``train_job`` label value
    replaced by ``label_of(value)``."""

    def __init__(self, registry: CollectorRegistry, label_of: Callable[[str], str]) -> None:
        self.registry = registry
        self.label_of = label_of

    def collect(self) -> Iterator[Metric]:
        label_of = self.label_of
        for family in self.registry.collect():
            family.samples = [
                sample._replace(labels={**sample.labels,
                                        JOB_LABEL: label_of(sample.labels[JOB_LABEL])})
                if JOB_LABEL in sample.labels else sample
                for sample in family.samples]
            yield family


def mask_job_labels(registry: CollectorRegistry,
                    label_of: Callable[[str], str]) -> CollectorRegistry:
    """What /metrics serves: ``registry`` with job names replaced by ``label_of`` (its
    ``JobAuthority.metrics_label``), for every family that has a ``train_job`` label."""
    masked = CollectorRegistry(auto_describe=False)
    masked.register(_JobLabelMask(registry, label_of))
    return masked

