"""What users reach for today instead of autotune, each run against the same emulated budget and
measured with the same probe harness.

- `trainer_defaults`: Hugging Face Trainer's defaults (micro-batch 8, fp32, no checkpointing,
  SDPA), with gradient accumulation to the benchmark's effective batch.
- `auto_find_batch_size`: Trainer's `auto_find_batch_size=True`, i.e. accelerate's real
  `find_executable_batch_size` started at `per_device_train_batch_size` (8), Trainer defaults
  otherwise. Each attempt is a probe; an OOM probe raises the error text accelerate's
  `should_reduce_batch_size` recognises, so the installed accelerate decides the next size (older
  versions halve, 1.x multiplies by 0.9).
- `lightning_binsearch`: Lightning's `Tuner.scale_batch_size(mode="binsearch")` with its defaults
  (start at 2, double until OOM, bisect, then its safety margin), each trial a probe. Reported as
  not installed where Lightning is absent.

Every finder's pick is a micro-batch; its accumulation is the nearest whole number that keeps the
effective batch (a user keeps the work per optimizer step, and tokens/s compares per token).
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.specs.models import ModelSpec
from autotune.results.probe_result import ProbeResult
from autotune.search.space import SearchSpace

TRAINER_MICRO_BATCH = 8  # transformers.TrainingArguments.per_device_train_batch_size default


@dataclass(frozen=True)
class Setting:
    """One benchmark case as the alternatives see it."""

    spec: ModelSpec
    space: SearchSpace
    budget: Budget  # the case's budget and the margin its probes keep
    device_type: str  # 'cuda' or 'cpu': picks the OOM wording the libraries expect
    new_runner: Callable[[], object]  # a fresh probe runner (ProbeRunner or a scripted fake)

    @property
    def effective_batch(self) -> int:
        assert self.space.effective_batch is not None, "the benchmark uses a fixed effective batch"
        return self.space.effective_batch

    @property
    def block_size(self) -> int:
        return self.space.block_sizes[0]

    def trainer_config(self, micro_batch: int) -> ProbeConfig:
        """Trainer defaults at `micro_batch`, accumulation to the nearest effective batch."""
        return ProbeConfig(
            model=self.space.model,
            micro_batch=micro_batch,
            block_size=self.block_size,
            grad_accum=max(1, round(self.effective_batch / micro_batch)),
            precision="fp32",
            checkpointing=False,
            attention="sdpa",
        )

    def oom_error(self, config: ProbeConfig) -> RuntimeError:
        """An out-of-memory error worded as PyTorch words it, which is what accelerate's
        `should_reduce_batch_size` and Lightning's `is_oom_error` look for."""
        if self.device_type == "cuda":
            return RuntimeError(f"CUDA out of memory. (autotune probe of {config.label()} went over the budget)")
        return RuntimeError(
            f"DefaultCPUAllocator: can't allocate memory: (autotune probe of {config.label()} went over the budget)"
        )


@dataclass
class AlternativeOutcome:
    name: str  # stable id: 'trainer-defaults', 'auto-find-batch-size', 'lightning-binsearch'
    title: str  # for tables and the plot
    status: str  # 'ok' | 'oom' (its pick does not fit) | 'failed' | 'not-installed'
    config: ProbeConfig | None = None  # its pick
    result: ProbeResult | None = None  # the pick measured by the probe harness
    tried: list[tuple[ProbeConfig, ProbeResult]] = field(default_factory=list)
    wall_seconds: float = 0.0
    note: str = ""

    @property
    def gpu_seconds(self) -> float:
        """Device time it spent: the wall time of every probe it ran."""
        return sum(r.wall_seconds or 0.0 for _, r in self.tried)


class _Prober:
    """Runs probes for one alternative, remembering each so a repeated size is not re-run."""

    def __init__(self, setting: Setting, runner) -> None:
        self.setting, self.runner = setting, runner
        self.tried: list[tuple[ProbeConfig, ProbeResult]] = []

    def probe(self, config: ProbeConfig) -> ProbeResult:
        for known, result in self.tried:
            if known.key() == config.key():
                return result
        result = self.runner.run(config, self.setting.budget, self.setting.spec)
        self.tried.append((config, result))
        return result


def _finish(outcome: AlternativeOutcome, config: ProbeConfig | None, result: ProbeResult | None) -> AlternativeOutcome:
    outcome.config, outcome.result = config, result
    if result is None:
        outcome.status = outcome.status if outcome.status != "ok" else "failed"
    elif result.status == "oom":
        outcome.status = "oom"
    elif result.status != "ok":
        outcome.status = "failed"
        outcome.note = outcome.note or f"its pick's probe ended {result.status}: {(result.error or '')[:200]}"
    return outcome


def trainer_defaults(setting: Setting) -> AlternativeOutcome:
    """Trainer's defaults as they are: one run at micro-batch 8, fp32, no checkpointing."""
    started = time.perf_counter()
    outcome = AlternativeOutcome("trainer-defaults", "Trainer defaults", "ok")
    config = setting.trainer_config(TRAINER_MICRO_BATCH)
    with closing(setting.new_runner()) as runner:
        prober = _Prober(setting, runner)
        result = prober.probe(config)
    outcome.tried, outcome.wall_seconds = prober.tried, time.perf_counter() - started
    if result.status == "oom":
        outcome.note = "out of memory: Trainer's defaults do not fit this budget"
    return _finish(outcome, config, result)


def auto_find_batch_size(setting: Setting, starting_batch_size: int = TRAINER_MICRO_BATCH) -> AlternativeOutcome:
    """Trainer's `auto_find_batch_size=True`: accelerate's `find_executable_batch_size`, called as
    `transformers.trainer_utils.find_executable_batch_size` calls it (no custom reduction)."""
    started = time.perf_counter()
    outcome = AlternativeOutcome("auto-find-batch-size", "auto_find_batch_size", "ok")
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        outcome.status, outcome.note = "not-installed", "accelerate is not installed"
        return outcome
    with closing(setting.new_runner()) as runner:
        prober = _Prober(setting, runner)

        def train(batch_size: int) -> tuple[ProbeConfig, ProbeResult]:
            config = setting.trainer_config(batch_size)
            result = prober.probe(config)
            if result.status == "oom":
                raise setting.oom_error(config)
            return config, result

        try:
            config, result = find_executable_batch_size(train, starting_batch_size=starting_batch_size)()
        except RuntimeError as exc:  # "No executable batch size found, reached zero."
            outcome.tried, outcome.wall_seconds = prober.tried, time.perf_counter() - started
            outcome.status, outcome.note = "oom", f"accelerate gave up: {exc}"
            return outcome
    outcome.tried, outcome.wall_seconds = prober.tried, time.perf_counter() - started
    outcome.note = "tried micro-batches " + ", ".join(str(c.micro_batch) for c, _ in prober.tried)
    return _finish(outcome, config, result)


def _import_lightning():
    """(lightning.pytorch or pytorch_lightning, its Tuner, the package name), or a string saying
    why neither can be used."""
    why = "lightning is not installed (pip install lightning)"
    for package in ("lightning", "pytorch_lightning"):
        try:
            if package == "lightning":
                import lightning.pytorch as pl
                from lightning.pytorch.tuner import Tuner
            else:
                import pytorch_lightning as pl
                from pytorch_lightning.tuner import Tuner
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != package:  # installed, but one of its dependencies is not
                why = f"{package} is installed but cannot be imported: {exc}"
            continue
        except Exception as exc:  # a broken install (versions that do not match): report it, measure the rest
            why = f"{package} is installed but cannot be imported: {type(exc).__name__}: {exc}"
            continue
        return pl, Tuner, package
    return why


def lightning_binsearch(setting: Setting, dataset_size: int = 1 << 16) -> AlternativeOutcome:
    """Lightning's batch-size finder in binsearch mode with its defaults; every trial is a probe.

    A stand-in LightningModule trains nothing itself: each new batch size the finder tries is
    probed, and an OOM probe raises the error Lightning's `is_oom_error` recognises. `dataset_size`
    is large, as a real data set is, so the data set's length does not stop the doubling.
    """
    started = time.perf_counter()
    outcome = AlternativeOutcome("lightning-binsearch", "Lightning binsearch", "ok")
    found = _import_lightning()
    if isinstance(found, str):
        outcome.status, outcome.note = "not-installed", found
        return outcome
    pl, Tuner, package = found
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    with closing(setting.new_runner()) as runner:
        prober = _Prober(setting, runner)

        class ProbingModule(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.batch_size = 2  # the attribute the finder scales (its init_val overrides it)
                self.weight = torch.nn.Parameter(torch.zeros(1))

            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.zeros(dataset_size, 1)), batch_size=self.batch_size)

            def training_step(self, batch, batch_idx):
                config = setting.trainer_config(self.batch_size)
                if prober.probe(config).status == "oom":
                    raise setting.oom_error(config)
                return (self.weight * batch[0]).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

        with tempfile.TemporaryDirectory(prefix="autotune-bench-lightning-") as root, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet = [logging.getLogger(name) for name in (package, f"{package}.pytorch", "lightning.fabric")]
            levels = [log.level for log in quiet]
            for log in quiet:
                log.setLevel(logging.ERROR)
            try:
                trainer = pl.Trainer(
                    accelerator="cpu",
                    devices=1,
                    max_epochs=1,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    default_root_dir=root,
                )
                size = Tuner(trainer).scale_batch_size(ProbingModule(), mode="binsearch")
            except RuntimeError as exc:
                outcome.tried, outcome.wall_seconds = prober.tried, time.perf_counter() - started
                outcome.status, outcome.note = "failed", f"Lightning's finder failed: {str(exc)[:200]}"
                return outcome
            finally:
                for log, level in zip(quiet, levels):
                    log.setLevel(level)
        if not size:
            outcome.tried, outcome.wall_seconds = prober.tried, time.perf_counter() - started
            outcome.status, outcome.note = "failed", "Lightning's finder returned no batch size"
            return outcome
        config = setting.trainer_config(int(size))
        result = prober.probe(config)  # its pick, measured (after its margin it may not have been tried)
    outcome.tried, outcome.wall_seconds = prober.tried, time.perf_counter() - started
    outcome.note = (
        f"{package} {_version(package)}; tried micro-batches "
        + ", ".join(str(c.micro_batch) for c, _ in prober.tried)
        + f"; picked {size}"
    )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The probes measure the card's memory outside their allocator as their context: a context
        # this parent process opened would be counted against them.
        outcome.note += (
            "; warning: Lightning initialised CUDA in the benchmark's process, so its probes' budget was tighter"
        )
    return _finish(outcome, config, result)


def _version(package: str) -> str:
    from autotune.host.environment import package_version

    return package_version("lightning" if package == "lightning" else "pytorch-lightning") or "?"


ALTERNATIVES: dict[str, Callable[[Setting], AlternativeOutcome]] = {
    "trainer-defaults": trainer_defaults,
    "auto-find-batch-size": auto_find_batch_size,
    "lightning-binsearch": lightning_binsearch,
}
