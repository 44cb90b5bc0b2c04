"""The probe child: the process that builds a model and runs real training steps.

This is the only place a probe touches torch or a device. It runs in a `spawn`ed process so that an
OOM's leftovers, a fragmented allocator or a poisoned CUDA context die with it. The parent
(`runner.py`) talks to it over a pipe (messages in `protocol.py`): one request, one reply, and the
child exits after any probe that did not end cleanly so that the next one starts from a fresh
process. The step it times is `step.py`'s.
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()

import contextlib  # noqa: E402  (the clock above must start before the heavy imports)
import dataclasses  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402  (imported here so that its cost counts as start-up, not build)

from autotune.vocabulary import errors  # noqa: E402
from autotune.levers import evaluation  # noqa: E402
from autotune.results.budget import required_bytes  # noqa: E402
from autotune.levers.config import ProbeConfig  # noqa: E402
from autotune.vocabulary.defaults import ERROR_TAIL_CHARS, MAX_MEASURE_STEPS, NOISY_WINDOW, WINDOW_GROWTH  # noqa: E402
from autotune.probe.cap import MemoryCap, cap_memory  # noqa: E402
from autotune.probe.devices import (  # noqa: E402
    describe,
    other_gpu_processes,
    peak_flops,
    resolve_device,
    supports_attention_dtype,
    supports_precision,
)
from autotune.probe.hygiene import CodeWatch, allocated_bytes, why_not_reused  # noqa: E402
from autotune.probe.oom import classify_exception  # noqa: E402
from autotune.probe.phase_run import LaterPhaseRun, PhaseMeter  # noqa: E402
import autotune.probe.distributed as distributed  # noqa: E402
import autotune.probe.speedups as speedups  # noqa: E402
from autotune.probe.protocol import (  # noqa: E402
    EnvironmentReply,
    EnvironmentRequest,
    ModelCheckReply,
    ModelCheckRequest,
    Phase,
    ProbeRequest,
    Ready,
    ResultReply,
    UserErrorReply,
)
from autotune.probe.batches import padding_free_problem  # noqa: E402
from autotune.probe.step import (  # noqa: E402
    OptimizerUnavailable,
    ProbeStep,
    build_random_model,
    check_recipe,
    from_config,
    import_recipe_code,
    make_optimizer,
    model_flops_per_token,
    parameter_count,
    task_config,
    with_adapters,
)
from autotune.results.probe_result import ProbeResult  # noqa: E402
from autotune.vocabulary.status import ProbeStatus  # noqa: E402
from autotune.results.timing import window_seconds  # noqa: E402

_IMPORT_SECONDS = time.perf_counter() - _PROCESS_START
# A random-init model warns about things irrelevant to a probe (unknown loss_type, token ids);
# real errors still raise.
transformers.logging.set_verbosity_error()
# The modules a patching library (Liger) replaces code in, as they were before any probe patched them.
_CODE = CodeWatch()
_probes_begun = 0  # in this process, the one in flight included


@dataclasses.dataclass(slots=True)
class _Probe:
    """One probe as it goes through its steps: what it runs on, what it built, what it measured."""

    request: ProbeRequest
    device: torch.device
    device_name: str
    result: ProbeResult
    cap: MemoryCap | None = None  # the budget applied (None for a probe skipped before it)
    model: Any = None
    hf_config: Any = None
    step: ProbeStep | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    start_allocated: int = 0  # what the accounting held as the probe began (cuBLAS workspaces on CUDA)
    meter: PhaseMeter | None = None  # the run's phases and each one's peaks (with the cap)
    caught_oom: bool = False  # an OOM was caught and the probe went on (--eval-batch auto)
    leftover_bytes: int = 0  # what it still held after the probe released everything

    @property
    def config(self) -> ProbeConfig:
        return self.request.config

    def skip(self, why: str) -> bool:
        """End the probe as skipped, with why; False (for `return probe.skip(...)` in a step)."""
        self.result.status, self.result.error = ProbeStatus.SKIPPED, why[:ERROR_TAIL_CHARS]
        return False


def run_probe_in_process(request: ProbeRequest, report: Callable[[str], None] = lambda phase: None) -> ProbeResult:
    """Run one probe in this process. Raises AutotuneError for problems the user must fix (a budget
    larger than the card); every other outcome, OOM included, is returned as a status."""
    return _probe_in_process(request, report).result


def _probe_in_process(request: ProbeRequest, report: Callable[[str], None]) -> _Probe:
    """run_probe_in_process, returning the whole probe (what it left behind decides whether this
    process runs the next one)."""
    global _probes_begun
    _probes_begun += 1
    probe = _start(request)
    if probe.cap is None:
        return probe
    speedups.set_tf32(probe.config)
    torch.manual_seed(0)
    try:
        # On CPU the accountant watches the build and the warm-up steps: after two optimizer steps
        # weights, gradients, optimizer state and activations have all reached their steady size,
        # and every later step repeats the same allocations. The timed window runs without it. (A
        # window for its timing alone, of a config measured before, needs no accounting.)
        with probe.cap.guard() if not request.timing_only else contextlib.nullcontext():
            if not _build(probe, report) or not _warm_up(probe, report):
                return probe
        if probe.config.compile and probe.device.type != "cuda" and not _compile(probe, report):
            return probe
        _time_window(probe, report)
        if evaluation.evaluates(probe.config) and not request.timing_only:
            with probe.cap.guard():  # (on CPU the accountant counts, and caps, what these phases hold)
                _later_phases(probe, report)
    except errors.AutotuneError:
        raise
    except Exception as exc:  # outcomes are data: OOM or not, the probe reports and the search goes on
        _failed(probe, exc)
        del exc  # its traceback holds the failing frames and their tensors
    finally:
        try:
            _release(probe)
        except Exception as exc:
            # After a device-side assert or an illegal access every CUDA call raises again: the
            # probe's own error stays the one reported (this process is not reused after it).
            if probe.result.status == ProbeStatus.OK:
                _failed(probe, exc)
            del exc
    _judge(probe)
    return probe


def _failed(probe: _Probe, exc: BaseException) -> None:
    probe.result.status = classify_exception(exc)
    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    phase = probe.meter.phase if probe.meter is not None else None
    if phase not in (evaluation.TRAIN, None):  # the training steps fitted: say which later phase did not
        probe.result.failed_phase = phase
        message = f"{phase} phase: {message}"
    probe.result.error = message[-ERROR_TAIL_CHARS:]


def _later_phases(probe: _Probe, report: Callable[[str], None]) -> None:
    """Evaluation (and generation) after the training steps (probe/phase_run.py)."""
    assert probe.step is not None and probe.meter is not None
    run = LaterPhaseRun(probe.step, probe.hf_config.vocab_size, probe.meter, report, lambda: _synchronize(probe.device))
    try:
        probe.result.eval_batch_found = run.run(probe.request.budget)
    finally:
        probe.caught_oom = run.caught_oom


def _start(request: ProbeRequest) -> _Probe:
    """The device, the recipe checked against it, and the budget applied: a probe ready to build,
    or one already skipped (a precision or speed lever this device cannot run)."""
    config, budget = request.config, request.budget
    device = resolve_device(request.settings.device)
    env = describe(device)
    result = ProbeResult(
        status=ProbeStatus.OK,
        device=env.device_name,
        device_total_bytes=env.device_total_bytes,
        budget_bytes=budget.total_bytes,
        margin_bytes=budget.margin_bytes,
        warmup_steps=request.settings.warmup_steps,
        measured_steps=request.settings.measure_steps,
        gpu_processes=other_gpu_processes(device),
    )
    check_recipe(config, device)
    import_recipe_code(config)
    probe = _Probe(request, device, env.device_name, result)
    unsupported = (
        supports_precision(device, config.precision)
        or speedups.unavailable(config, device)
        or supports_attention_dtype(config.attention, config.precision, config.weights)
        or distributed.unavailable(config, device)
    )
    if unsupported:
        probe.skip(unsupported)
        return probe
    probe.cap = cap_memory(device, budget)
    probe.meter = PhaseMeter(probe.cap)
    result.cap_bytes, result.context_bytes = probe.cap.cap_bytes, probe.cap.context_bytes
    probe.start_allocated = allocated_bytes(probe.cap)
    return probe


def _build(probe: _Probe, report: Callable[[str], None]) -> bool:
    """Build the model, its optimizer and the step (Liger patched in where asked). False when the
    probe ends skipped: a kernel this model or machine lacks, a block past its positions, an
    optimizer that cannot run here."""
    request, config, result = probe.request, probe.config, probe.result
    started = time.perf_counter()
    report("build")
    try:
        build = distributed.build_model if config.ranks > 1 else build_random_model
        probe.model, probe.hf_config = build(request.model, config, probe.device, request.settings.trust_remote_code)
    except (ImportError, ValueError) as exc:
        if "attn" in str(exc).lower() or "attention" in str(exc).lower():
            why = "this model does not implement it" if _model_lacks_kernel(str(exc)) else "not available here"
            return probe.skip(f"attention {config.attention!r}: {why}: {_first_line(exc)}")
        raise
    if config.block_size > (getattr(probe.hf_config, "max_position_embeddings", None) or config.block_size):
        return probe.skip(f"block size {config.block_size} exceeds the model's maximum positions")
    _CODE.note()  # the modules this model's build imported, as they are before anything patches them
    if config.liger and (why_not := speedups.apply_liger(probe.model, probe.hf_config.model_type)):
        return probe.skip(why_not)
    if (why_not := padding_free_problem(probe.model, config, probe.hf_config.vocab_size, probe.device)) is not None:
        return probe.skip(why_not)
    result.parameters = parameter_count(probe.model)
    result.trainable_parameters = parameter_count(probe.model, trainable=True)
    try:
        optimizer = make_optimizer(probe.model, probe.device, config.optimizer)
    except OptimizerUnavailable as exc:
        return probe.skip(f"optimizer {config.optimizer}: {exc}")
    probe.step = ProbeStep(probe.model, optimizer, config, probe.device, probe.hf_config.vocab_size)
    result.build_seconds = time.perf_counter() - started
    return True


def _warm_up(probe: _Probe, report: Callable[[str], None]) -> bool:
    """The warm-up steps that bring memory to its steady peak. On CUDA a compiled step is accounted
    like any other: compile first, then warm up. On CPU the accountant cannot see inside one
    (speedups.py): it warms up eagerly and compiles after (run_probe_in_process)."""
    if probe.config.compile and probe.device.type == "cuda" and not _compile(probe, report):
        return False
    report("warm-up")
    assert probe.step is not None
    # The first step makes the optimizer state; a window for its timing alone needs no second one
    # (the second is for the memory peak with that state in place), unless it is this process's
    # first probe: then the first step also pays the process's first calls (kernels loaded, pools
    # grown), and the window starts after the usual warm-up.
    warm_process = _probes_begun > 1
    for _ in range(1 if probe.request.timing_only and warm_process else probe.request.settings.warmup_steps):
        probe.losses.append(probe.step())
    return True


def _time_window(probe: _Probe, report: Callable[[str], None]) -> None:
    """Time steps until the window has both its steps and its seconds; each step ends by reading
    its loss (a host sync), so each duration is that step's own. Then the throughput and MFU.
    Batches drawn from the data's lengths are timed in whole cycles, at least two (autotune.levers.lengths),
    each cycle's micro-batches made before its first step, outside the steps' times."""
    settings, config, result, step = probe.request.settings, probe.config, probe.result, probe.step
    assert step is not None
    _synchronize(probe.device)
    report("timing")
    step_times: list[float] = []
    window_start, cycle = time.perf_counter(), config.timing_cycle
    least = settings.measure_steps if cycle is None else 2 * cycle * -(-settings.measure_steps // (2 * cycle))

    def wants_more() -> bool:
        if len(step_times) < least or (cycle is not None and len(step_times) % cycle):  # (cycles are timed whole)
            return True
        if len(step_times) >= max(MAX_MEASURE_STEPS, least):
            return False
        elapsed = time.perf_counter() - window_start
        if elapsed < settings.measure_seconds:
            return True
        # A probe's noisy window (a busy machine) grows before it is taken, within WINDOW_GROWTH
        # times its seconds (the probe's timeout and the command's deadline still hold it: runner.py).
        # A window of the confirmation round does not: the round repeats windows instead.
        return (
            not probe.request.timing_only
            and (window_seconds(step_times, cycle)[1] or 0.0) > NOISY_WINDOW
            and elapsed < WINDOW_GROWTH * settings.measure_seconds
        )

    # Ranks step together: each would judge the window by its own clock, and one that stopped
    # while another took a step more would leave it waiting in that step's collectives.
    go_on = distributed.all_agree if config.ranks > 1 else (lambda wanted, device: wanted)
    while go_on(wants_more(), probe.device):
        if cycle is not None and len(step_times) % cycle == 0:
            step.draw_cycle(len(step_times) // cycle)
        step_started = time.perf_counter()
        probe.losses.append(step())
        _synchronize(probe.device)
        step_times.append(time.perf_counter() - step_started)
    step.drawn = None  # (the later phases and the next window start from the worst batch again)
    result.measured_seconds = time.perf_counter() - window_start
    result.measured_steps, result.step_times = len(step_times), step_times
    result.step_seconds, result.step_spread = window_seconds(step_times, cycle)
    if result.compile_seconds is not None:  # the first compiled step, less what a step costs anyway
        result.compile_seconds = max(0.0, result.compile_seconds - result.step_seconds)
    result.tokens_per_s = config.tokens_per_step / result.step_seconds
    result.samples_per_s = config.effective_batch / result.step_seconds
    peak = peak_flops(probe.device_name, config.precision) if probe.device.type == "cuda" else None
    if peak:
        result.mfu = result.tokens_per_s * model_flops_per_token(probe.model, probe.hf_config, config) / peak


def _release(probe: _Probe) -> None:
    """Read the peaks and the losses, then free the model and the step before the next probe."""
    assert probe.cap is not None
    _record_memory(probe)
    if probe.losses:
        probe.result.first_loss, probe.result.last_loss = probe.losses[0], probe.losses[-1]
    probe.model = probe.step = probe.hf_config = None
    probe.cap.release()
    probe.leftover_bytes = max(0, allocated_bytes(probe.cap) - probe.start_allocated)


def _judge(probe: _Probe) -> None:
    """An OK probe is unstable if a loss was not finite, and out of memory if, with the CUDA
    context grown as kernels loaded, it would not have fitted a card of the budget's size even
    though the allocator stayed under its cap."""
    result, budget = probe.result, probe.request.budget
    if result.status != ProbeStatus.OK:
        return
    if not all(math.isfinite(x) for x in probe.losses):
        result.status = ProbeStatus.UNSTABLE
        result.error = (
            f"non-finite loss in {sum(not math.isfinite(x) for x in probe.losses)} of {len(probe.losses)} steps"
        )
    elif result.required_bytes is not None and not budget.fits(result.required_bytes):
        result.status = ProbeStatus.OOM
        result.error = (
            f"peak reserved {result.peak_reserved_bytes} + context {result.context_bytes} + margin "
            f"{budget.margin_bytes} bytes exceed the {budget.total_bytes}-byte budget"
        )
        # The first phase over the budget is the one that does not fit.
        over = [
            phase
            for phase, peaks in (result.phase_peaks or {}).items()
            if not budget.fits(required_bytes(peaks["reserved"], result.context_bytes) or 0)
        ]
        if over and over[0] != evaluation.TRAIN:
            result.failed_phase = over[0]
            result.error = f"{over[0]} phase: {result.error}"


def _compile(probe: _Probe, report: Callable[[str], None]) -> bool:
    """Compile the step's model and run its first compiled step, which compiles it: its time goes to
    `result.compile_seconds` (less a step's own, once the window has timed one), never to the
    window. False, with the result skipped and why, when compiling fails or takes longer than
    --max-compile-seconds; an OOM or any other error of the step propagates as usual."""
    step, result = probe.step, probe.result
    assert step is not None
    report("compile")
    step.compile_forward()
    started = time.perf_counter()
    try:
        probe.losses.append(step())
        _synchronize(step.device)
    except Exception as exc:
        if not speedups.is_compile_failure(exc):
            raise
        return probe.skip(f"torch.compile failed: {_first_line(exc)}")
    result.compile_seconds = time.perf_counter() - started
    bound = probe.request.settings.max_compile_seconds
    if bound is not None and result.compile_seconds > bound:
        return probe.skip(f"torch.compile took {result.compile_seconds:.1f} s, over --max-compile-seconds {bound:g}")
    return True


def check_buildable(request: ModelCheckRequest) -> ModelCheckReply:
    """Build the model on the meta device with each attention kernel: raises a user error for a
    config transformers cannot read, a model with no class for the task, a model the probe cannot
    build, or a kernel missing here."""
    check_recipe(request.config, resolve_device(request.device))
    spec = request.model
    what = f"--model {spec.reference} ({spec.model_type})"
    try:
        hf_config = task_config(spec.hf_config(request.trust_remote_code), request.config)
    except (ValueError, KeyError, TypeError, OSError, ImportError) as exc:
        raise errors.ModelNotFound(
            f"{what}: transformers cannot read its config.json ({_first_line(exc)}); fix the "
            f"config or pass another --model."
        ) from None
    parameters = 0
    unsupported: list[tuple[str, str]] = []
    for attention in request.attentions:
        try:
            with torch.device("meta"):
                model = from_config(
                    hf_config,
                    dataclasses.replace(request.config, attention=attention),
                    request.trust_remote_code,
                    dtype=torch.float32,
                )
        except (ImportError, ValueError, KeyError, TypeError, AttributeError, NotImplementedError, RuntimeError) as exc:
            text = _first_line(exc)
            if _model_lacks_kernel(text):
                # The model's class has no such kernel (deberta, led, gpt_neo and sdpa): the
                # search goes on with the others, and this kernel's probes are skipped with why.
                unsupported.append((attention, text[:300]))
                continue
            if attention in text or "attn" in text.lower() or "attention" in text.lower():
                raise errors.DeviceError(
                    f"--attention {attention} cannot run here ({text[:300]}); leave it out of --attention."
                ) from None
            raise errors.ModelNotFound(
                f"{what} cannot be built for {request.config.task} ({text[:300]}); pass another --model or --task."
            ) from None
        parameters = sum(p.numel() for p in model.parameters())
        if request.config.peft is not None:
            with torch.device("meta"):
                with_adapters(model, request.config)  # LoRA targets that match nothing: a user error
        del model
    if len(unsupported) == len(request.attentions):
        kernels = "; ".join(f"{attention}: {why}" for attention, why in unsupported)
        raise errors.DeviceError(
            f"{what} supports none of the attention kernels asked for ({kernels[:400]}); pass "
            f"--attention with another (eager is implemented by every model)."
        )
    return ModelCheckReply(parameters=parameters, unsupported=tuple(unsupported))


def _model_lacks_kernel(text: str) -> bool:
    """transformers' "X does not support ... attention ...": the model's class lacks the kernel."""
    return "does not support" in text and ("attention" in text.lower() or "attn" in text.lower())


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_memory(probe: _Probe) -> None:
    """The peaks of the phase in progress, and the probe's: the largest of its phases'."""
    result, cap, meter = probe.result, probe.cap, probe.meter
    assert cap is not None and meter is not None
    if probe.request.timing_only and cap.device.type != "cuda":
        return  # nothing was accounted (its memory is the earlier probe's)
    if not evaluation.evaluates(probe.config) or probe.request.timing_only:
        result.peak_allocated_bytes, result.peak_reserved_bytes = cap.peaks()
    else:
        meter.end()
        result.phase_peaks = dict(meter.peaks) or None
        result.peak_allocated_bytes, result.peak_reserved_bytes = meter.largest()
    if cap.device.type == "cuda":
        result.context_bytes = max(result.context_bytes or 0, cap.context_now())


def serve(conn) -> None:
    """The child's main loop: answer requests on `conn` until told to stop or a probe ends unclean."""
    # The imports made ~10^6 long-lived objects; freezing them keeps each probe's full
    # gc.collect() (needed to free the last model before the next) at milliseconds, not ~0.4 s.
    gc.collect()
    gc.freeze()
    _CODE.note()
    conn.send(Ready(startup_seconds=_IMPORT_SECONDS))
    while True:
        try:
            request = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if request is None:
            return
        try:
            if isinstance(request, EnvironmentRequest):
                conn.send(EnvironmentReply(describe(resolve_device(request.device))))
                continue
            if isinstance(request, ModelCheckRequest):
                conn.send(check_buildable(request))
                continue
            probe = _probe_in_process(request, lambda phase: _report(conn, request, phase))
        except errors.AutotuneError as exc:
            conn.send(UserErrorReply(exc))
            continue
        except Exception as exc:
            if not isinstance(request, ProbeRequest):
                raise
            # Something the probe's own handling did not catch: its message still reaches the
            # parent (not a bare exit code), and this process ends.
            conn.send(ResultReply(_unexpected(request, exc), why_not_reused="the probe failed outside its steps"))
            return
        why = why_not_reused(probe.result, probe.device, probe.leftover_bytes, _CODE.replaced(), probe.caught_oom)
        conn.send(ResultReply(probe.result, why_not_reused=why))
        if why is not None:
            return
        # The first probe imports transformers' model code lazily: ~10^5 more long-lived objects.
        # Freezing what survived this probe (its model is collected by now) keeps the next one's
        # gc.collect() at milliseconds (measured: 0.19 s a probe otherwise, tiny GPT-2).
        gc.freeze()


def _unexpected(request: ProbeRequest, exc: BaseException) -> ProbeResult:
    """A probe that failed where it does not catch failures (its start, its release), as its result."""
    budget = request.budget
    return ProbeResult(
        status=classify_exception(exc),
        budget_bytes=budget.total_bytes,
        margin_bytes=budget.margin_bytes,
        error="".join(traceback.format_exception_only(type(exc), exc)).strip()[-ERROR_TAIL_CHARS:],
    )


def _report(conn, request: ProbeRequest, phase: str) -> None:
    """Tell the parent the probe reached `phase`; before a held window, wait for its Go."""
    conn.send(Phase(phase))
    if phase == "timing" and request.hold_before_timing:
        conn.recv()


def main(conn) -> None:  # the spawn target
    # Ctrl-C goes to the whole process group; the parent decides when a probe stops, so the
    # child ignores SIGINT and finishes (or is killed by) the parent instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(conn)
    finally:
        conn.close()
