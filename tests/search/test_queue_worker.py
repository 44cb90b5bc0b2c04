"""The queue worker reads how a search ended from what the search says it did (`search --json`) and
from the store, never from its log: a real search whose stderr is swallowed and replaced by a
misleading error line still ends `finished` with the pick as stored; a child that says nothing is
not read as finished; a search the worker cannot run is refused in process with the reason the
check raised, no child started."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from autotune.search.queue_worker import QueueWorker, WorkerDevice
from autotune.vocabulary.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from autotune.service.submissions import ServicePolicy, submission_of
from autotune.vocabulary.status import SearchState
from autotune.store import open_store
from tests.helpers.models import write_model_dir

MISLEADING = "autotune: error: the model was not found (misleading)"


@pytest.fixture
def queued(tmp_path, hermetic_home):
    """A store holding one submitted search of a tiny GPT-2 on CPU, taken by this worker."""
    root = tmp_path / "models"
    write_model_dir(root / "tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    db = f"sqlite:///{tmp_path / 'queue.db'}"
    body = {
        "model": "tiny",
        "gpu_budget": "200MiB",
        "device": "cpu",
        "micro_batches": [1, 2],
        "block_sizes": "32",
        "effective_batch": 2,
        "precisions": "fp32",
        "checkpointing": "off",
        "attention": "sdpa",
        "confirm": False,
    }
    submission = submission_of(body, ServicePolicy(model_root=root))
    with open_store(db) as store:
        store.queue.submit(submission)
        device = WorkerDevice("cpu", "cpu", "cpu: test", None, 1, "f")

        def make(worker_class=QueueWorker):
            worker = worker_class(store, db, device, say=lambda line: None)
            search = store.queue.take(worker.label, device.can_serve)
            assert search is not None
            return worker, search

        yield store, make, root


class Misleading(QueueWorker):
    """The real search, its stderr swallowed and a wrong error line said in its place."""

    def search_command(self, search):
        script = f'"$0" "$@" 2>/dev/null; status=$?; echo "{MISLEADING}" >&2; exit $status'
        return ["sh", "-c", script, *super().search_command(search)]


class Silent(QueueWorker):
    """A child that exits 0 having said nothing."""

    def search_command(self, search):
        return [sys.executable, "-c", "pass"]


class NeverStarts(QueueWorker):
    def search_command(self, search):
        raise AssertionError("a refused search starts no child")


@pytest.mark.slow  # (a real search of a tiny model on CPU, in a child)
def test_a_misleading_log_does_not_change_how_the_search_ended(queued):
    store, make, _ = queued
    worker, search = make(Misleading)
    assert worker.run_search(search) == SearchState.FINISHED
    ended = store.queue.get(search.name)
    pick = store.leaderboard(search.name, top=1)[0]
    assert ended.state == SearchState.FINISHED and ended.exit_status == 0
    assert ended.reason == f"every candidate settled; the pick: {pick.label}, {pick.tokens_per_s:,.0f} tokens/s"
    assert "misleading" not in ended.reason


def test_a_child_that_says_no_outcome_is_not_read_as_finished(queued):
    store, make, _ = queued
    worker, search = make(Silent)
    assert worker.run_search(search) == SearchState.FAILED
    ended = store.queue.get(search.name)
    assert ended.reason.startswith("the search process ended with exit status 0 before saying an outcome")


def test_a_search_this_worker_cannot_run_is_refused_in_process_with_the_checks_reason(queued):
    store, make, root = queued
    shutil.rmtree(root / "tiny")  # (the model named at submission is gone by the time a worker takes it)
    worker, search = make(NeverStarts)
    assert worker.run_search(search) == SearchState.FAILED
    ended = store.queue.get(search.name)
    assert ended.reason.startswith("refused by its worker: ") and str(root / "tiny") in ended.reason
    assert ended.exit_status is None


@pytest.mark.slow  # (two real worker processes, each device described by a probe child)
def test_queue_workers_are_connected_while_they_serve_and_say_their_signal_by_exit_status(tmp_path, hermetic_home):
    """Two workers on one queue: both read as connected (store/workers.py) while they serve, each
    with its device; SIGTERM ends one with 143 and Ctrl-C the other with 130 (0 before: a supervisor
    read it as done; 143 for both before: a Ctrl-C read as a kill), and each leaves the registry."""
    db = f"sqlite:///{tmp_path / 'q.db'}"
    command = [sys.executable, "-m", "autotune", "worker", "--queue", "--device", "cpu", "--db", db]
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in "ab"]
    try:
        for worker in workers:
            assert "serving the queue" in worker.stdout.readline()  # (waiting for work: nothing queued)
        with open_store(db) as store:
            connected = {w.label: w for w in store.workers.connected()}
            assert {label.rsplit(":", 1)[1] for label in connected} == {str(w.pid) for w in workers}
            assert all(w.device.kind == "cpu" and w.device.ranks >= 1 for w in connected.values())
            by_term, by_interrupt = workers
            by_term.send_signal(signal.SIGTERM)
            by_interrupt.send_signal(signal.SIGINT)
            assert by_term.wait(timeout=60) == EXIT_TERMINATED
            assert by_interrupt.wait(timeout=60) == EXIT_INTERRUPTED
            assert store.workers.connected() == []
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
