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

import dataclasses  # noqa: E402  (the clock above must start before the heavy imports)
import gc  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402,F401  (imported here so that its cost counts as start-up, not build)

from autotune import errors  # noqa: E402
from autotune.defaults import ERROR_TAIL_CHARS, MAX_MEASURE_STEPS  # noqa: E402
from autotune.probe.budget import EnforcedBudget, enforce_budget  # noqa: E402
from autotune.probe.memory import BUDGET_OOM  # noqa: E402
from autotune.probe.devices import describe, peak_flops, resolve_device, supports_precision  # noqa: E402
from autotune.probe.oom import classify_exception  # noqa: E402
from autotune.probe import speedups  # noqa: E402
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
from autotune.models import ModelSpec  # noqa: E402
from autotune.probe.step import (  # noqa: E402
    OptimizerUnavailable,
    ProbeStep,
    check_recipe,
    import_recipe_code,
    build_model,
    flops_per_token,
    from_config,
    make_optimizer,
    parameter_count,
    task_config,
    with_adapters,
)
from autotune.result import ProbeResult  # noqa: E402
from autotune.status import CLEAN, ProbeStatus  # noqa: E402
from autotune.timing import median_seconds, relative_spread  # noqa: E402

_IMPORT_SECONDS = time.perf_counter() - _PROCESS_START
# A random-init model warns about things irrelevant to a probe (unknown loss_type, token ids);
# real errors still raise.
transformers.logging.set_verbosity_error()


def run_probe_in_process(request: ProbeRequest, report: Callable[[str], None] = lambda phase: None) -> ProbeResult:
    """Run one probe in this process. Raises AutotuneError for problems the user must fix (a budget
    larger than the card); every other outcome, OOM included, is returned as a status."""
    config, budget_bytes, margin_bytes = request.config, request.budget_bytes, request.margin_bytes
    device = resolve_device(request.device)
    env = describe(device)
    result = ProbeResult(
        status=ProbeStatus.OK, device=env.device_name, device_total_bytes=env.device_total_bytes,
        budget_bytes=budget_bytes, margin_bytes=margin_bytes, warmup_steps=request.warmup_steps,
        measured_steps=request.measure_steps,
    )
    check_recipe(config, device)
    import_recipe_code(config)
    unsupported = supports_precision(device, config.precision) or speedups.unavailable(config, device)
    if unsupported:
        result.status, result.error = ProbeStatus.SKIPPED, unsupported
        return result
    budget = enforce_budget(device, budget_bytes, margin_bytes)
    result.cap_bytes, result.context_bytes = budget.cap_bytes, budget.context_bytes

    speedups.set_tf32(config)
    torch.manual_seed(0)
    model = optimizer = step = None
    losses: list[float] = []
    try:
        started = time.perf_counter()
        # On CPU the accountant watches the build and the warm-up steps: after two optimizer steps
        # weights, gradients, optimizer state and activations have all reached their steady size,
        # and every later step repeats the same allocations. The timed window runs without it.
        with budget.guard():
            report("build")
            try:
                model, hf_config = build_model(request.model_config, request.model_path, config, device,
                                               request.trust_remote_code)
            except (ImportError, ValueError) as exc:
                if "attn" in str(exc).lower() or "attention" in str(exc).lower():
                    result.status = ProbeStatus.SKIPPED
                    why = "this model does not implement it" if _model_lacks_kernel(str(exc)) else "not available here"
                    result.error = f"attention {config.attention!r}: {why}: {_first_line(exc)}"[:ERROR_TAIL_CHARS]
                    return result
                raise
            if config.block_size > (getattr(hf_config, "max_position_embeddings", None) or config.block_size):
                result.status = ProbeStatus.SKIPPED
                result.error = f"block size {config.block_size} exceeds the model's maximum positions"
                return result
            if config.liger:
                why_not = speedups.apply_liger(model, hf_config.model_type)
                if why_not:
                    result.status, result.error = ProbeStatus.SKIPPED, why_not
                    return result
            result.parameters = parameter_count(model)
            result.trainable_parameters = parameter_count(model, trainable=True)
            try:
                optimizer = make_optimizer(model, device, config.optimizer)
            except OptimizerUnavailable as exc:
                result.status, result.error = ProbeStatus.SKIPPED, f"optimizer {config.optimizer}: {exc}"
                return result
            step = ProbeStep(model, optimizer, config, device, hf_config.vocab_size)
            result.build_seconds = time.perf_counter() - started
            # On CUDA a compiled step is accounted like any other: compile first, then warm up.
            # On CPU the accountant cannot see inside one (speedups.py): warm up eagerly, then compile.
            if config.compile and device.type == "cuda" and not _compile(step, losses, result, request, report):
                return result
            report("warm-up")
            for _ in range(request.warmup_steps):
                losses.append(step())

        if config.compile and device.type != "cuda" and not _compile(step, losses, result, request, report):
            return result
        _synchronize(device)
        report("timing")
        # Each step ends by reading its loss (a host sync), so each duration is that step's own.
        step_times: list[float] = []
        window_start = time.perf_counter()
        while len(step_times) < request.measure_steps or (
                time.perf_counter() - window_start < request.measure_seconds and len(step_times) < MAX_MEASURE_STEPS):
            step_started = time.perf_counter()
            losses.append(step())
            _synchronize(device)
            step_times.append(time.perf_counter() - step_started)
        window = time.perf_counter() - window_start
    except errors.AutotuneError:
        raise
    except Exception as exc:  # outcomes are data: OOM or not, the probe reports and the search goes on
        result.status = classify_exception(exc)
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        result.error = text[-ERROR_TAIL_CHARS:]
        del exc  # its traceback holds the failing frames and their tensors
    else:
        result.measured_seconds = window
        result.measured_steps, result.step_times = len(step_times), step_times
        result.step_seconds = median_seconds(step_times)
        result.step_spread = relative_spread(step_times)
        if result.compile_seconds is not None:  # the first compiled step, less what a step costs anyway
            result.compile_seconds = max(0.0, result.compile_seconds - result.step_seconds)
        result.tokens_per_s = config.tokens_per_step / result.step_seconds
        result.samples_per_s = config.effective_batch / result.step_seconds
        peak = peak_flops(env.device_name, config.precision) if device.type == "cuda" else None
        if peak:
            result.mfu = result.tokens_per_s * flops_per_token(model, hf_config, config.block_size) / peak
    finally:
        _record_memory(result, budget)
        if losses:
            result.first_loss, result.last_loss = losses[0], losses[-1]
        del model, optimizer, step
        budget.release()

    if result.status == ProbeStatus.OK and not all(math.isfinite(x) for x in losses):
        result.status = ProbeStatus.UNSTABLE
        result.error = f"non-finite loss in {sum(not math.isfinite(x) for x in losses)} of {len(losses)} steps"
    if result.status == ProbeStatus.OK and result.required_bytes is not None and result.required_bytes + margin_bytes > budget_bytes:
        # The allocator stayed under its cap, but the CUDA context grew while kernels loaded: on a
        # card of the budget's size this configuration would not have fitted.
        result.status = ProbeStatus.OOM
        result.error = (f"peak reserved {result.peak_reserved_bytes} + context {result.context_bytes} + margin "
                        f"{margin_bytes} bytes exceed the {budget_bytes}-byte budget")
    return result


def _compile(step: ProbeStep, losses: list[float], result: ProbeResult, request: ProbeRequest,
             report: Callable[[str], None]) -> bool:
    """Compile the step's model and run its first compiled step, which compiles it: its time goes to
    `result.compile_seconds` (less a step's own, once the window has timed one), never to the
    window. False, with the result skipped and why, when compiling fails or takes longer than
    --max-compile-seconds; an OOM or any other error of the step propagates as usual."""
    report("compile")
    step.compile_forward()
    started = time.perf_counter()
    try:
        losses.append(step())
        _synchronize(step.device)
    except Exception as exc:
        if not speedups.is_compile_failure(exc):
            raise
        result.status = ProbeStatus.SKIPPED
        result.error = f"torch.compile failed: {_first_line(exc)}"[:ERROR_TAIL_CHARS]
        return False
    result.compile_seconds = time.perf_counter() - started
    bound = request.max_compile_seconds
    if bound is not None and result.compile_seconds > bound:
        result.status = ProbeStatus.SKIPPED
        result.error = f"torch.compile took {result.compile_seconds:.1f} s, over --max-compile-seconds {bound:g}"
        return False
    return True


def check_model(request: ModelCheckRequest) -> ModelCheckReply:
    """Build the model on the meta device with each attention kernel: raises a user error for a
    config transformers cannot read, a model with no class for the task, a model the probe cannot
    build, or a kernel missing here."""
    check_recipe(request.config, resolve_device(request.device))
    spec = ModelSpec("--model", request.model_config, "probe", request.model_path)
    what = f"the model ({spec.model_type})"
    try:
        hf_config = task_config(spec.hf_config(request.trust_remote_code), request.config)
    except (ValueError, KeyError, TypeError, OSError, ImportError) as exc:
        raise errors.ModelNotFound(f"{what}: transformers cannot read its config.json ({_first_line(exc)}); fix the "
                                   f"config or pass another --model.") from None
    parameters = 0
    unsupported: list[tuple[str, str]] = []
    for attention in request.attentions:
        try:
            with torch.device("meta"):
                model = from_config(hf_config, dataclasses.replace(request.config, attention=attention),
                                    request.trust_remote_code, dtype=torch.float32)
        except (ImportError, ValueError, KeyError, TypeError, AttributeError, NotImplementedError, RuntimeError) as exc:
            text = _first_line(exc)
            if _model_lacks_kernel(text):
                # The model's class has no such kernel (deberta, led, gpt_neo and sdpa): the
                # search goes on with the others, and this kernel's probes are skipped with why.
                unsupported.append((attention, text[:300]))
                continue
            if attention in text or "attn" in text.lower() or "attention" in text.lower():
                raise errors.DeviceError(f"--attention {attention} cannot run here ({text[:300]}); leave it out of "
                                         f"--attention.") from None
            raise errors.ModelNotFound(f"{what} cannot be built for {request.config.task} ({text[:300]}); "
                                       f"pass another --model or --task.") from None
        parameters = sum(p.numel() for p in model.parameters())
        if request.config.peft is not None:
            with torch.device("meta"):
                with_adapters(model, request.config)  # LoRA targets that match nothing: a user error
        del model
    if len(unsupported) == len(request.attentions):
        kernels = "; ".join(f"{attention}: {why}" for attention, why in unsupported)
        raise errors.DeviceError(f"{what} supports none of the attention kernels asked for ({kernels[:400]}); pass "
                                 f"--attention with another (eager is implemented by every model).")
    return ModelCheckReply(parameters=parameters, unsupported=tuple(unsupported))


def _model_lacks_kernel(text: str) -> bool:
    """transformers' "X does not support an attention implementation through ..." (or "... Flash
    Attention ... yet"): the model's class, not this machine, lacks the kernel."""
    return "does not support" in text and ("attention" in text.lower() or "attn" in text.lower())


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_memory(result: ProbeResult, budget: EnforcedBudget) -> None:
    result.peak_allocated_bytes, result.peak_reserved_bytes = budget.peaks()
    if budget.device.type == "cuda":
        result.context_bytes = max(result.context_bytes or 0, budget.context_now())


def serve(conn) -> None:
    """The child's main loop: answer requests on `conn` until told to stop or a probe ends unclean."""
    # The imports made ~10^6 long-lived objects; freezing them keeps each probe's full
    # gc.collect() (needed to free the last model before the next) at milliseconds, not ~0.4 s.
    gc.collect()
    gc.freeze()
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
                conn.send(check_model(request))
                continue
            result = run_probe_in_process(request, lambda phase: _report(conn, request, phase))
        except errors.AutotuneError as exc:
            conn.send(UserErrorReply(type(exc).__name__, str(exc)))
            continue
        goes_on = trusted_after(result, request.device)
        conn.send(ResultReply(result, child_goes_on=goes_on))
        if not goes_on:
            return
        # The first probe imports transformers' model code lazily: ~10^5 more long-lived objects.
        # Freezing what survived this probe (its model is collected by now) keeps the next one's
        # gc.collect() at milliseconds (measured: 0.19 s a probe otherwise, tiny GPT-2).
        gc.freeze()


def trusted_after(result: ProbeResult, device: str) -> bool:
    """Whether this process may run the next probe after `result`. After a CUDA OOM or any fault
    it may not: the caching allocator stays fragmented, a traceback may hold tensors, a device-side
    assert poisons the context. The CPU accountant's OOM is an exception of our own, raised as the
    allocation is counted, with every frame released on the way out: nothing is left to distrust,
    and the restart (seconds of imports) is saved. A real host OOM still gets a fresh process."""
    if result.status in CLEAN:
        return True
    return result.status == ProbeStatus.OOM and BUDGET_OOM in (result.error or "") and resolve_device(device).type == "cpu"


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
