"""The problems search strategies are measured on (benchmarks/search_strategies.py): the memory
and speed of every candidate of a space, known in advance, so that any strategy can be run against
them in milliseconds a probe and its pick held against the best that fits.

- Modelled problems (`MODELLED`): a cost model of a transformer fine-tune on a CUDA card, at three
  sizes. Memory: the weights, gradients and optimizer state, one more set of gradients when
  accumulating, and activations per token (less in half precision, far less with checkpointing,
  more with eager attention's scores). Time per micro-step: a fixed overhead (launches, Python)
  plus compute per token, each lever changing the two differently (half precision speeds the
  compute, not the launches; compile fuses launches away), so a product of per-lever factors, the
  search's own speed model, does not fit it exactly. A deterministic +-2% per config stands for
  a config's own departure
  from the model (twins that differ only in the allocator share it: the same kernels).
- Replayed problems (`replays()`): real studies in which every configuration of a space was
  probed once (`autotune search --strategy grid-full` under a budget everything fits), stored
  with `python -m benchmarks.problems record` under benchmarks/results/studies/. A config fits a
  smaller budget when its measured need does (on a CPU the accountant's OOM is exactly that rule);
  its speed and its probe's wall time are the ones measured.

    python -m benchmarks.problems record --db URL --study NAME --out FILE [--title TEXT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult
from autotune.search import Prediction
from autotune.search.space import SearchSpace
from autotune.vocabulary.status import ProbeStatus

GiB, MiB = 2**30, 2**20
STUDIES = Path(__file__).resolve().parent / "results" / "studies"
MARGIN = 0.05  # the search's default safety margin, a share of the budget


@dataclass(frozen=True)
class Problem:
    """A space whose every candidate's need, speed and probe time are known."""

    name: str
    kind: str  # 'modelled' or 'replayed'
    space: SearchSpace
    device_type: str
    budgets: tuple[int, ...]
    measured: Callable[[ProbeConfig], ProbeResult]  # the candidate's probe under a budget everything fits
    source: str = ""  # where a replay's figures come from

    def answer(self, config: ProbeConfig, budget: Budget) -> ProbeResult:
        """What probing `config` under `budget` gives: its measurement, or an OOM."""
        result = self.measured(config)
        need = result.required_bytes or 0
        if budget.fits(need):
            return replace(result, budget_bytes=budget.total_bytes, margin_bytes=budget.margin_bytes)
        # An OOM stops at the first step that runs past the cap: about a build and one step.
        wall = (result.build_seconds or 0.0) + (result.startup_seconds or 0.0) + (result.step_seconds or 0.0)
        return ProbeResult(
            status=ProbeStatus.OOM,
            device=result.device,
            budget_bytes=budget.total_bytes,
            margin_bytes=budget.margin_bytes,
            peak_reserved_bytes=budget.allowed_bytes,
            context_bytes=result.context_bytes,
            error="torch.OutOfMemoryError: out of memory (replayed)",
            wall_seconds=wall or result.wall_seconds,
        )

    def best(self, budget: Budget, space: SearchSpace | None = None) -> tuple[ProbeConfig, float] | None:
        """The fastest candidate of `space` (the problem's own by default) that fits `budget`, with its tokens/s."""
        fitting = [
            (c, self.measured(c).tokens_per_s or 0.0)
            for c in (space or self.space).candidates()
            if budget.fits(self.measured(c).required_bytes or 0)
        ]
        return max(fitting, key=lambda item: item[1]) if fitting else None

    def predictions(
        self, error: float | Callable[[ProbeConfig], float] = 0.0, space: SearchSpace | None = None
    ) -> dict[str, Prediction]:
        """Predictions of every candidate of `space` (the problem's own by default) off by `error`
        (a share, or one per config) from its measurement."""
        out = {}
        for config in (space or self.space).candidates():
            result = self.measured(config)
            off = error(config) if callable(error) else error
            scale = 1 + off
            context = result.context_bytes or 0
            allocated = int((result.peak_allocated_bytes or 0) * scale)
            out[config.key()] = Prediction(allocated, allocated + context, int((result.required_bytes or 0) * scale))
        return out


def budget_of(total_bytes: int) -> Budget:
    return Budget.of(total_bytes, MARGIN)


# --- modelled ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """A fine-tune's memory and time on a CUDA card, by lever (see the module's docstring)."""

    fixed_bytes: int  # weights, gradients, optimizer state, context
    accumulation_bytes: int  # the set of gradients kept alive while accumulating
    activation_bytes_per_token: int  # fp32, no checkpointing, SDPA
    compute_seconds_per_token: float  # fp32, at full utilisation
    launch_seconds: float  # per micro-step: kernel launches and Python
    optimizer_seconds: float  # per optimizer step
    build_seconds: float  # model build and optimizer set-up, per probe
    noise: float = 0.02

    def activation_share(self, c: ProbeConfig) -> float:
        share = {"fp16": 0.6, "bf16": 0.6}.get(c.precision, 1.0)
        share *= 0.25 if c.checkpointing else 1.0  # layer inputs only, one layer recomputed
        share *= 1 + c.block_size / 2048 if c.attention == "eager" else 1.0  # the S x S scores
        share *= 0.85 if c.compile else 1.0  # inductor frees some intermediates
        share *= 0.93 if c.allocator == "expandable" else 1.0  # less fragmentation
        return share

    def micro_step_seconds(self, c: ProbeConfig) -> float:
        compute = {"fp16": 0.35, "bf16": 0.35, "tf32": 0.6}.get(c.precision, 1.0)
        compute *= (4 / 3) if c.checkpointing else 1.0
        compute *= 1.12 if c.attention == "eager" else 1.0
        compute *= 0.9 if c.compile else 1.0
        launches = self.launch_seconds * (1.3 if c.checkpointing else 1.0) * (0.4 if c.compile else 1.0)
        return launches + c.micro_batch * c.block_size * self.compute_seconds_per_token * compute

    def result(self, c: ProbeConfig) -> ProbeResult:
        need = (
            self.fixed_bytes
            + (self.accumulation_bytes if c.grad_accum > 1 else 0)
            + int(self.activation_bytes_per_token * c.micro_batch * c.block_size * self.activation_share(c))
        )
        step = c.grad_accum * self.micro_step_seconds(c) + self.optimizer_seconds
        # (Twins that differ only in the allocator run the same kernels: the same figure.)
        kernels = replace(c, allocator="default").key()
        digest = int(hashlib.sha256(kernels.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        step *= 1 + self.noise * (2 * digest - 1)
        build = self.build_seconds + (40.0 if c.compile else 0.0)
        return ProbeResult(
            status=ProbeStatus.OK,
            device="modelled CUDA card",
            peak_allocated_bytes=int(need * 0.97),
            peak_reserved_bytes=need,
            context_bytes=0,
            step_seconds=step,
            tokens_per_s=c.tokens_per_step / step,
            samples_per_s=c.effective_batch / step,
            build_seconds=build,
            wall_seconds=build + 5 * step,
        )


def _gib(*values: float) -> tuple[int, ...]:
    return tuple(int(v * GiB) for v in values)


# gpt2 (124M) fp32 AdamW: 2 GiB of state, and at micro-batch 8 x 512 about 6 GiB of activations
# (a forum user's 8.06 GiB allocated); an A100-like card. The larger ones scale the state, the
# activations per token and the compute with the parameters.
MODELLED = {
    "modelled gpt2 (124M)": (
        CostModel(
            fixed_bytes=2 * GiB,
            accumulation_bytes=GiB // 2,
            activation_bytes_per_token=int(1.5 * MiB),
            compute_seconds_per_token=6.4e-5,
            launch_seconds=0.004,
            optimizer_seconds=0.005,
            build_seconds=6.0,
        ),
        _gib(3, 4, 5, 6, 7, 8, 10, 12),
    ),
    "modelled 350M": (
        CostModel(
            fixed_bytes=int(5.6 * GiB),
            accumulation_bytes=int(1.4 * GiB),
            activation_bytes_per_token=3 * MiB,
            compute_seconds_per_token=1.8e-4,
            launch_seconds=0.008,
            optimizer_seconds=0.014,
            build_seconds=10.0,
        ),
        _gib(7, 8, 10, 12, 16, 20, 24, 32),
    ),
    "modelled 1.3B": (
        CostModel(
            fixed_bytes=21 * GiB,
            accumulation_bytes=5 * GiB,
            activation_bytes_per_token=6 * MiB,
            compute_seconds_per_token=6.5e-4,
            launch_seconds=0.016,
            optimizer_seconds=0.05,
            build_seconds=25.0,
        ),
        _gib(24, 28, 32, 40, 48, 56, 64, 80),
    ),
}


def modelled(space_of: Callable[[], SearchSpace]) -> list[Problem]:
    return [
        Problem(name, "modelled", space_of(), "cuda", budgets, cost.result)
        for name, (cost, budgets) in MODELLED.items()
    ]


# --- replayed ------------------------------------------------------------------------------------
def replays(directory: Path = STUDIES, budgets_per_study: int = 5) -> list[Problem]:
    """Every recorded study of `directory` as a problem, at budgets where its answer changes."""
    return [
        replay(json.loads(path.read_text()), budgets_per_study, source=path.name)
        for path in sorted(directory.glob("*.json"))
    ]


def replay(recorded: dict, budgets_per_study: int = 5, source: str = "") -> Problem:
    space = SearchSpace.from_stored(recorded["space"])
    rows = {}
    for row in recorded["probes"]:
        config = ProbeConfig(**row["config"])
        rows[config.key()] = ProbeResult.from_dict(row["result"])
    missing = [c.label() for c in space.candidates() if c.key() not in rows]
    if missing:
        raise ValueError(f"{source}: no probe of {', '.join(missing[:3])}...: record a grid-full study of the space")
    return Problem(
        recorded["title"],
        "replayed",
        space,
        recorded["device_type"],
        _budgets(list(rows.values()), budgets_per_study),
        lambda c: rows[c.key()],
        source=f"{source} ({recorded['device']}, {recorded['date']})",
    )


def _budgets(results: list[ProbeResult], count: int) -> tuple[int, ...]:
    """`count` budgets spread evenly from one that just fits the config needing least to one that
    just fits the config needing most (everything fits), each just above a config's need, so
    that each binds a different frontier."""
    needs = sorted({r.required_bytes or 0 for r in results})
    low, high = needs[0], needs[-1]
    picks = [max(n for n in needs if n <= low + (high - low) * i / (count - 1)) for i in range(count)]
    return tuple(sorted({math.ceil(need / (1 - MARGIN)) + 1 for need in picks}))


def record(db: str, study: str, title: str) -> dict:
    """A grid-full study of `db` as a replayable problem (every probe, the space, the machine)."""
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        record_ = store.study(study)
        probes = [p for p in store.probes(study) if p.result.status == ProbeStatus.OK]
    model = record_.space["model"]
    name = Path(model).name

    def renamed(config: ProbeConfig) -> dict:
        return {**config.to_dict(), "model": name}

    keep = (
        "status",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "context_bytes",
        "step_seconds",
        "step_spread",
        "tokens_per_s",
        "samples_per_s",
        "startup_seconds",
        "build_seconds",
        "compile_seconds",
        "measured_seconds",
        "wall_seconds",
        "step_times",
        "host_load",
        "device",
    )
    return {
        "title": title,
        "device": record_.device_name,
        "device_type": record_.environment.get("device_type", "cpu"),
        "date": record_.created_at.date().isoformat(),
        "budget_bytes": record_.budget_bytes,
        "environment": record_.environment,
        "space": {**record_.space, "model": name},
        "probes": [{"config": renamed(p.config), "result": {k: getattr(p.result, k) for k in keep}} for p in probes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="store a grid-full study as a replayable problem")
    rec.add_argument("--db", required=True)
    rec.add_argument("--study", required=True)
    rec.add_argument("--title", required=True)
    rec.add_argument("--out", required=True)
    args = parser.parse_args()
    data = record(args.db, args.study, args.title)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.out}: {len(data['probes'])} probes of {args.title}")


if __name__ == "__main__":
    main()
