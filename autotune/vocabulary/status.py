"""Every status and stop reason autotune stores or reports, in one place. StrEnum members compare
equal to their strings, so rows written as plain text read back as members without conversion."""

from __future__ import annotations

from enum import StrEnum


class ProbeStatus(StrEnum):
    OK = "ok"  # ran and fits the budget
    OOM = "oom"  # out of memory against the budget
    ERROR = "error"  # raised something else (message tail kept)
    TIMEOUT = "timeout"  # killed after its limit
    CRASHED = "crashed"  # the child process died without a result
    UNSTABLE = "unstable"  # the loss was not finite
    SKIPPED = "skipped"  # not run: unsupported here, or ruled out by structure or prediction


# A status that says the configuration does not fit: larger ones will not fit either.
DOES_NOT_FIT = frozenset({ProbeStatus.OOM})
# Outcomes that say something lasting about a config on an environment: another search may reuse
# them instead of probing again. timeout, crashed and error may be transient (a busy machine, a
# killed child, a bug since fixed), so they are probed again.
CACHEABLE = frozenset({ProbeStatus.OK, ProbeStatus.OOM, ProbeStatus.UNSTABLE, ProbeStatus.SKIPPED})
# Statuses that say nothing about a config's memory need: a resumed search tries them again.
RETRYABLE = frozenset({ProbeStatus.TIMEOUT, ProbeStatus.CRASHED, ProbeStatus.ERROR})
# After these the child's allocator or CUDA context cannot be trusted: it exits, the next probe
# gets a fresh process.
CLEAN = frozenset({ProbeStatus.OK, ProbeStatus.SKIPPED})


class StudyStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"  # every candidate measured or ruled out
    INCOMPLETE = "incomplete"  # searched through, but some candidates could not be measured
    INTERRUPTED = "interrupted"  # stopped before the end (Ctrl-C, SIGTERM, a limit)


class SearchState(StrEnum):
    """A search submitted to the service (autotune serve), from the queue to its end."""

    QUEUED = "queued"  # waiting for a worker that can serve it
    RUNNING = "running"  # a queue worker runs it
    FINISHED = "finished"  # every candidate measured or ruled out (a pick, or nothing fits)
    INTERRUPTED = "interrupted"  # stopped before the end (its worker stopped or died, a --timeout): resumable
    FAILED = "failed"  # refused by the worker, or some candidates could not be measured
    CANCELLED = "cancelled"  # a client asked it to stop: resumable by submitting it again


# States a search does not leave on its own: a follower of its events stops there.
SEARCH_ENDED = frozenset({SearchState.FINISHED, SearchState.INTERRUPTED, SearchState.FAILED, SearchState.CANCELLED})


class RunStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # Ctrl-C, SIGTERM, or its process gone (read so: store/liveness.py)


class RunEnd(StrEnum):
    """How a full fine-tune ended, as its summary says (the stored RunStatus is finished or failed)."""

    FINISHED = "finished"
    OOM = "oom"
    ERROR = "error"
    INTERRUPTED = "interrupted"


class ClaimState(StrEnum):
    RUNNING = "running"  # a worker probes its config
    DONE = "done"  # the config is settled
    CRASHED = "crashed"  # abandoned by its workers too often


class StopReason(StrEnum):
    """Why a search worker stopped."""

    EXHAUSTED = "exhausted"  # every candidate settled
    PATIENCE = "patience"  # that many probes without a better config
    FINISHED = "finished"  # another worker finished the study
    STOPPED = "stopped"  # the study was stopped (by the search that started it)
    INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM
    MAX_TRIALS = "max-trials"
    TIMEOUT = "timeout"


# The stop reasons after which the study is done.
FINISHING = frozenset({StopReason.EXHAUSTED, StopReason.PATIENCE, StopReason.FINISHED})


class Settled(StrEnum):
    """How a search settled a candidate, as its progress line says."""

    PROBED = "probed"  # measured by a probe of this search (or of another worker of the study)
    REUSED = "reused"  # a stored result of an earlier study, same config and environment
    SKIPPED = "skipped"  # ruled out without a probe (structure, prediction, unsupported)
    CONFIRMING = "confirming"  # a contender measured again by the confirmation round (search/confirm.py)


class SettleHow(StrEnum):
    """How an outcome reached the store (Store.settle)."""

    CLAIMED = "claimed"  # probed under this worker's claim
    UNCLAIMED = "unclaimed"  # a skip or a reused result: nothing was claimed
    ABANDONED = "abandoned"  # recorded for a claim whose workers kept dying
