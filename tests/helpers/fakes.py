"""A scripted probe runner: search and store tests run in milliseconds without torch.

Memory and speed follow a simple model of a transformer (memory grows with micro-batch and block
size, less with checkpointing and half precision, and by a set of gradients when accumulating;
throughput grows with micro-batch and saturates), or replay recorded results.
"""

from __future__ import annotations

from collections.abc import Callable

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.environment import Environment
from autotune.specs.models import resolve_model
from autotune.results.probe_result import ProbeResult
from autotune.search import Prediction, SearchOptions, run_search
from autotune.search.space import SearchSpace

MiB = 2**20
FAKE_ENV = Environment(
    device_type="cuda",
    device_name="Fake GPU 16GB",
    device_total_bytes=16 * 2**30,
    cuda_version="13.0",
    torch_version="2.13.0",
    transformers_version="5.23.0",
)


def modelled_result(config: ProbeConfig, budget_bytes: int, margin_bytes: int) -> ProbeResult:
    half = config.precision in ("fp16", "bf16")
    per_token = (
        (0.35 if config.checkpointing else 1.0) * (0.6 if half else 1.0) * (1.3 if config.attention == "eager" else 1.0)
    )
    # Speed levers: inductor fuses away some activations; expandable segments fragment less.
    per_token *= (0.85 if config.compile else 1.0) * (0.93 if config.allocator == "expandable" else 1.0)
    peak = 500 * MiB + int(per_token * config.micro_batch * config.block_size * 64 * 1024)
    if config.grad_accum > 1:
        peak += 125 * MiB  # accumulating keeps a full set of gradients alive through the next micro-step
    if peak + margin_bytes > budget_bytes:
        return ProbeResult(
            status="oom",
            peak_reserved_bytes=budget_bytes - margin_bytes,
            budget_bytes=budget_bytes,
            margin_bytes=margin_bytes,
            error="torch.OutOfMemoryError: CUDA out of memory (fake)",
            wall_seconds=1.0,
        )
    speed = 10_000 * (config.micro_batch / (config.micro_batch + 4)) * (2.0 if half else 1.0)
    speed *= (0.75 if config.checkpointing else 1.0) * (0.85 if config.attention == "eager" else 1.0)
    speed *= 1.3 if config.compile else 1.0
    step = config.tokens_per_step / speed
    return ProbeResult(
        status="ok",
        device=FAKE_ENV.device_name,
        peak_allocated_bytes=peak - 10 * MiB,
        peak_reserved_bytes=peak,
        context_bytes=0,
        budget_bytes=budget_bytes,
        margin_bytes=margin_bytes,
        step_seconds=step,
        tokens_per_s=speed,
        samples_per_s=config.effective_batch / step,
        wall_seconds=2.0,
    )


class ScriptedRunner:
    """Answers probes from `table` (config key -> ProbeResult), `answer` (config, budget ->
    ProbeResult) or the model above; records every config it was asked to run."""

    def __init__(
        self,
        table: dict[str, ProbeResult] | None = None,
        env: Environment = FAKE_ENV,
        answer: Callable[[ProbeConfig, Budget], ProbeResult] | None = None,
    ):
        self.table, self.env, self.answer = table, env, answer
        self.asked: list[ProbeConfig] = []
        self.on_phase = None
        self.neighbours = None

    def environment(self, deadline=None) -> Environment:
        return self.env

    def check(self, spec, config, attentions, deadline=None) -> dict[str, str]:
        """The scripted model always builds, with every kernel."""
        return {}

    def run(
        self, config: ProbeConfig, budget: Budget, spec=None, deadline=None, timing_only=False, fresh_process=False
    ) -> ProbeResult:
        self.asked.append(config)
        if self.table is not None:
            return ProbeResult.from_dict(self.table[config.key()].to_dict())
        if self.answer is not None:
            return self.answer(config, budget)
        return modelled_result(config, budget.total_bytes, budget.margin_bytes)

    def close(self) -> None:
        pass


def request(space, spec, budget_bytes: int, margin_bytes: int, options=None, settings=None):
    """A SearchRequest of `space` under a budget with a margin in bytes (the search's own)."""
    from autotune.search import SearchRequest

    return SearchRequest.of(space, spec, Budget(budget_bytes, margin_bytes), options, settings)


# -- a search over gpt2's space with the scripted runner ------------------------------------------

GiB = 2**30
BUDGET = 1 * GiB
MARGIN = int(0.05 * BUDGET)


def gpt2_space(**overrides) -> SearchSpace:
    # 72 candidates: six micro-batches up to an effective batch of 32 sequences.
    return SearchSpace.build(
        resolve_model("gpt2"),
        **{"micro_batches": (1, 2, 4, 8, 16, 32), "block_sizes": (512,), "effective_batch": 32, **overrides},
    )


def search(store, runner, space, predictor=None, **options):
    options.setdefault("predict", predictor is not None)
    return run_search(
        request(space, resolve_model("gpt2"), BUDGET, MARGIN, SearchOptions(**options)),
        runner,
        store,
        predictor=predictor,
    )


def modelled_predictor(error: float = 0.0):
    """Predictions from the fake runner's own memory model, off by `error` (0.1 = 10% high)."""

    def predict(candidates, device_type):
        out = {}
        for c in candidates:
            peak = modelled_result(c, 10**15, 0).peak_reserved_bytes
            need = int(peak * (1 + error))
            out[c.key()] = Prediction(peak_bytes=need, floor_bytes=need, required_bytes=need)
        return out

    return predict


def fake_estimate(config: ProbeConfig, need: int):
    """A CUDA estimate of `config` that needs `need` bytes at its peak."""
    from autotune.estimate import MemoryEstimate

    return MemoryEstimate(
        config=config,
        device_type="cuda",
        params=need // 8,
        grads=0,
        optimizer=need // 4,
        activations=need // 2,
        temporaries=need // 8,
        workspace=0,
        peak_bytes=need,
        reserved_bytes=need + 64 * MiB,
        context_bytes=500 * MiB,
        seconds=0.0,
    )
