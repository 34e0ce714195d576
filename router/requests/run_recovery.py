"""Whether a request whose worker failed may be placed again, and what its error says.

Retry: a producer that fails before token 0 has cost the client nothing yet, so the run
places the request again, up to ``prefill_retries`` times, never on a producer it failed
on. Migration: any other worker failure moves the request, up to ``max_migrations`` times,
to a slot avoiding every worker that failed it, with the tokens its client already has
(router/requests/request_run.py). This object keeps the counts and the failed workers; the run
tears down and replaces the legs.
"""

from __future__ import annotations

from router.control.registry import WorkerInfo


class Recovery:
    def __init__(self, prefill_retries: int, max_migrations: int) -> None:
        self.prefill_retries = prefill_retries
        self.max_migrations = max_migrations
        self.attempt = 1  # placements so far; the legs of attempt n > 1 use another leg id
        self.retries = 0  # placements after a producer failed before token 0
        self.migrations = 0  # placements after another failure
        self.failed: set[str] = set()  # ids of the workers that failed it (for messages)
        # ... and those registrations: never placed there again (a restarted worker
        # registers anew and may take it)
        self.failed_on: list[WorkerInfo] = []
        self.reason: str | None = None  # why the current legs are being replaced
        self.migrating = False  # the current replacement is a migration
        # the current retry's producer refused the request as busy (its queue is full):
        # with no other producer, the client is refused (RESOURCE_EXHAUSTED), not failed
        self.busy = False

    def fail_on(self, w: WorkerInfo) -> None:
        self.failed.add(w.worker_id)
        if all(x is not w for x in self.failed_on):
            self.failed_on.append(w)

    def may_retry(self, p: WorkerInfo, why: str, client_saw_tokens: bool,
                  busy: bool = False) -> bool:
        """A producer failed (or, ``busy``, refused) before token 0: only while neither the
        client nor the consumer has anything from it, and within ``prefill_retries``."""
        if client_saw_tokens:
            return False
        self.fail_on(p)
        if self.retries >= self.prefill_retries:
            return False
        self.retries += 1
        self.reason, self.busy = why, busy
        return True

    def may_migrate(self, w: WorkerInfo, why: str, stopped: bool) -> bool:
        """Any other failure: within ``max_migrations``, and not once the request was
        stopped from outside (an abort or shutdown then ends it)."""
        self.fail_on(w)
        if self.migrations >= self.max_migrations or stopped:
            return False
        self.reason, self.migrating = why, True
        return True

    def take(self) -> tuple[str, bool, bool]:
        """The pending replacement's reason, kind (a migration?) and whether it is a busy
        producer's retry; cleared."""
        why, self.reason = self.reason or "a worker failed", None
        migrating, self.migrating = self.migrating, False
        busy, self.busy = self.busy, False
        return why, migrating, busy

    def describe(self, error: str) -> str:
        """A final error, with the attempts that led to it."""
        failed = ", ".join(sorted(self.failed))
        if self.migrations:
            return (f"{error} (attempt {self.attempt}: {self.migrations} migration(s) of at "
                    f"most {self.max_migrations}, {self.retries} "
                    f"retr{'y' if self.retries == 1 else 'ies'}; failed on: {failed})")
        if self.attempt > 1:
            return (f"{error} (attempt {self.attempt} of {self.prefill_retries + 1}; failed "
                    f"before token 0: {failed})")
        return error

    def no_slot(self, why: str) -> str:
        return f"{why}; no other producer to retry on (tried {', '.join(sorted(self.failed))})"
