"""The search: which configurations to probe, in what order, and when to stop.

An Optuna study (stored in the same database as autotune's tables) records every trial: a probe
that fits is a completed trial valued by its tokens/s; an OOM is a completed trial that violates
the memory constraint (Optuna's TPE ignores failed trials, so an OOM told as a failure would be
proposed again). What to probe next is chosen by a strategy:

- `predictive` (default): predicts every candidate's speed with a model refitted after each probe
  (speed_model.py: a factor per lever value, their interactions, and how uncertain each is) and
  its memory with the estimator; probes the candidate whose optimistic speed is highest (plain
  configs before speed levers, and those predicted to fit before those the prediction cannot
  decide), and stops when no candidate left could beat the best measured, skipping each with what
  it could reach. Structure caps the model: a config is no faster than its twin without
  checkpointing or with the default allocator, and (on CUDA) than a larger micro-batch of its family
  measured. A config predicted over the budget by less than the prediction margin is verified by
  a probe if it could win, never skipped; a speed lever is tried only where its plain twin was
  probed (the plain frontier says where it could win).
- `frontier`: uses the structure of the problem. Inside a group of configs that differ only in
  micro-batch, memory grows with the micro-batch, so a binary search finds the largest one that
  fits; throughput grows with the micro-batch at a fixed effective batch, so the group's best is at
  that frontier, which one more probe (the next smaller micro-batch) confirms. An OOM skips every
  larger config of the same precision, checkpointing and attention; a config that fits without
  checkpointing skips the same config with it (same memory need met, less work).
- `tpe`: Optuna's TPE sampler with the memory constraint, plus the same OOM skipping.
- `grid`: every candidate, smallest first, with OOM skipping; `grid-full` probes even those.

`benchmarks/search_strategies.py` measures each against modelled and replayed problems (probes,
probe-seconds, the pick's quality against the exhaustive grid's best); that measurement is why
`predictive` is the default.

Several workers can share one study (`autotune worker`, `autotune search --workers N`; see
fleet.py): each claims a configuration in the database before probing it (Store.claim), so every
configuration is probed once whichever worker takes it, and reads what the others found before
each pick, so an OOM found by one prunes for all. Configurations in flight on other workers are
unavailable to the strategies, and so are those an in-flight probe could rule out (speculative):
a worker with nothing else to do waits for the results instead of probing what may prove needless.

Where things live, in the order data flows: `launch.py` (flags to a running search),
`request.py` (the search resolved once: `SearchRequest`, preflight, stored answers), `common.py`
(options, events, outcomes, the Runner protocol), `plan.py` (what a study stores for joining
workers), `predictions.py` (the estimator's part), `knowledge.py` (what is known and what it rules
out), `speed_model.py` (the predictive strategy's model of speed), `strategies.py`, `trials.py`
(Optuna), `worker_state.py` (claims' heartbeat, a worker's view of the others), `driver.py` (starting or resuming a study), `loop.py` (choose, settle, learn: the
loop every worker runs), `confirm.py` (the confirmation round), `fleet.py` (several worker
processes).
"""

from __future__ import annotations

from autotune.search.common import STRATEGIES, Event, Runner, SearchOptions, SearchOutcome
from autotune.search.driver import run_search, start_study
from autotune.search.fleet import join_study, run_worker, search_with_workers, worker_settings
from autotune.search.knowledge import Knowledge
from autotune.search.launch import search
from autotune.search.loop import SearchLoop, stop_on_first_interrupt, work
from autotune.search.study_plan import StudyPlan
from autotune.search.predictions import Prediction, predict
from autotune.search.request import SearchRequest, default_study_name, finished_study, preflight, resolve_search
from autotune.search.strategies import FrontierStrategy, GridStrategy, TpeStrategy, make_strategy
from autotune.search.trials import Trials, distributions_of
from autotune.search.worker_state import Heartbeat, WorkerState, worker_label

__all__ = [
    "STRATEGIES",
    "Event",
    "FrontierStrategy",
    "GridStrategy",
    "Heartbeat",
    "Knowledge",
    "Prediction",
    "Runner",
    "SearchLoop",
    "SearchOptions",
    "SearchOutcome",
    "SearchRequest",
    "StudyPlan",
    "TpeStrategy",
    "Trials",
    "WorkerState",
    "default_study_name",
    "distributions_of",
    "finished_study",
    "join_study",
    "make_strategy",
    "predict",
    "preflight",
    "resolve_search",
    "run_search",
    "run_worker",
    "search",
    "search_with_workers",
    "start_study",
    "stop_on_first_interrupt",
    "work",
    "worker_label",
    "worker_settings",
]
