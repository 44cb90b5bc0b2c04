"""The probe worker: the child process that builds a model and runs real training steps.

This is the only place a probe touches torch or a device. It runs in a `spawn`ed process so that an
OOM's leftovers, a fragmented allocator or a poisoned CUDA context die with it. The parent
(`runner.py`) talks to it over a pipe: one request, one reply, and the worker exits after any probe
that did not end cleanly so that the next one starts from a fresh process.
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()

import contextlib  # noqa: E402  (the clock above must start before the heavy imports)
import gc  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402,F401  (imported here so that its cost counts as start-up, not build)

from autotune.config import ProbeConfig  # noqa: E402
from autotune.errors import AutotuneError  # noqa: E402
from autotune.models import ModelSpec  # noqa: E402
from autotune.probe.devices import describe, peak_flops, resolve_device, supports_precision  # noqa: E402
from autotune.probe.memory import CpuMemoryAccountant, apply_cuda_budget, measure_cuda_context  # noqa: E402
from autotune.probe.oom import classify_exception  # noqa: E402
from autotune.result import ProbeResult  # noqa: E402

_IMPORT_SECONDS = time.perf_counter() - _PROCESS_START
# A random-init model warns about things irrelevant to a probe (unknown loss_type, token ids);
# real errors still raise.
transformers.logging.set_verbosity_error()
_ERROR_TAIL = 2000  # characters of an error message kept in the result

# Test hook: makes the worker misbehave on purpose, so that the parent's handling of hangs, hard
# crashes, non-finite losses and unexpected exceptions is tested with the real process machinery.
FAULT_ENV = "AUTOTUNE_TEST_FAULT"


def build_model(model_config: dict, model_path: str | None, config: ProbeConfig, device: torch.device, trust_remote_code: bool):
    """A randomly initialised causal LM built directly on `device`; memory and speed do not depend
    on the weights' values, so no checkpoint is read."""
    from transformers import AutoModelForCausalLM

    spec = ModelSpec(config.model, model_config, "probe", model_path)
    hf_config = spec.hf_config(trust_remote_code)
    hf_config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    with torch.device(device):
        # fp32 master weights whatever dtype the checkpoint was saved in: mixed precision is
        # autocast over fp32 weights, as Trainer does with fp16=True/bf16=True.
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=config.attention,
                                                 trust_remote_code=trust_remote_code, dtype=torch.float32)
    model.train()
    if config.checkpointing:
        # Non-reentrant checkpointing is what PyTorch recommends and what Trainer uses by default.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model, hf_config


def make_optimizer(model, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as Trainer uses it (`adamw_torch_fused` where the device has the fused kernel)."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=5e-5, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=5e-5, foreach=device.type == "cuda")


def flops_per_token(model, hf_config, block_size: int) -> float:
    """Training FLOPs per token: 6N for the weights plus attention's 12*L*d*T (PaLM, appendix B).
    Recomputation under checkpointing is not counted: MFU measures useful work."""
    n_params = sum(p.numel() for p in model.parameters())
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    hidden = getattr(hf_config, "hidden_size", 0) or 0
    return 6 * n_params + 12 * layers * hidden * block_size


class Trainer:
    """The training step of a probe: `grad_accum` micro-steps, then one optimizer step."""

    def __init__(self, model, optimizer, config: ProbeConfig, device: torch.device, vocab_size: int, fault: str | None):
        self.model, self.optimizer, self.config, self.device, self.fault = model, optimizer, config, device, fault
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        # Two synthetic batches of the right shape and vocabulary, alternated: like a data loader's
        # prefetched batch, they are part of the memory a real run holds.
        shape = (config.micro_batch, config.block_size)
        self.batches = [torch.randint(0, vocab_size, shape, device=device) for _ in range(2)]

    def step(self) -> float:
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.config.grad_accum):
            input_ids = self.batches[micro % 2]
            with self.autocast():
                loss = self.model(input_ids=input_ids, labels=input_ids).loss / self.config.grad_accum
            if self.fault == "nan":
                loss = loss * float("nan")
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            loss_sum += loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.item())  # one host sync per optimizer step, as a training loop's logging does


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_probe_in_process(request: dict) -> ProbeResult:
    """Run one probe in this process. Raises AutotuneError for problems the user must fix (a budget
    larger than the card); every other outcome, OOM included, is returned as a status."""
    config = ProbeConfig.from_dict(request["config"])
    budget_bytes, margin_bytes = int(request["budget_bytes"]), int(request["margin_bytes"])
    warmup_steps, measure_steps = int(request["warmup_steps"]), int(request["measure_steps"])
    fault = os.environ.get(FAULT_ENV) or None
    device = resolve_device(request["device"])
    env = describe(device)
    result = ProbeResult(
        status="ok", device=env.device_name, device_total_bytes=env.device_total_bytes,
        budget_bytes=budget_bytes, margin_bytes=margin_bytes, warmup_steps=warmup_steps, measured_steps=measure_steps,
    )
    unsupported = supports_precision(device, config.precision)
    if unsupported:
        result.status, result.error = "skipped", unsupported
        return result

    accountant: CpuMemoryAccountant | None = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        gc.collect()
        torch.cuda.empty_cache()
        budget = apply_cuda_budget(device, budget_bytes, margin_bytes)
        torch.cuda.reset_peak_memory_stats(device)
        result.cap_bytes, result.context_bytes = budget.cap_bytes, budget.context_bytes
    else:
        from autotune.errors import BudgetError
        from autotune.units import format_size

        if env.device_total_bytes and budget_bytes > env.device_total_bytes:
            raise BudgetError(f"--gpu-budget {format_size(budget_bytes)} is larger than this machine's memory ({format_size(env.device_total_bytes)}); give less.")
        result.cap_bytes, result.context_bytes = budget_bytes - margin_bytes, 0
        accountant = CpuMemoryAccountant(cap_bytes=result.cap_bytes)

    torch.manual_seed(0)
    model = optimizer = trainer = None
    losses: list[float] = []
    try:
        started = time.perf_counter()
        # On CPU the accountant watches the build and the warm-up steps: after two optimizer steps
        # weights, gradients, optimizer state and activations have all reached their steady size,
        # and every later step repeats the same allocations. The timed window runs without it.
        with accountant if accountant is not None else contextlib.nullcontext():
            try:
                model, hf_config = build_model(request["model_config"], request.get("model_path"), config, device, request.get("trust_remote_code", False))
            except (ImportError, ValueError) as exc:
                if "attn" in str(exc).lower() or "attention" in str(exc).lower():
                    result.status, result.error = "skipped", f"attention {config.attention!r} is not available here: {exc}"[:_ERROR_TAIL]
                    return result
                raise
            if config.block_size > (getattr(hf_config, "max_position_embeddings", None) or config.block_size):
                result.status, result.error = "skipped", f"block size {config.block_size} exceeds the model's maximum positions"
                return result
            optimizer = make_optimizer(model, device)
            trainer = Trainer(model, optimizer, config, device, hf_config.vocab_size, fault)
            result.build_seconds = time.perf_counter() - started
            for _ in range(warmup_steps):
                losses.append(trainer.step())

        _synchronize(device)
        window_start = time.perf_counter()
        for i in range(measure_steps):
            if fault == "hang":
                time.sleep(10**6)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "error":
                raise RuntimeError("injected failure (AUTOTUNE_TEST_FAULT=error)")
            losses.append(trainer.step())
        _synchronize(device)
        window = time.perf_counter() - window_start
    except AutotuneError:
        raise
    except Exception as exc:  # outcomes are data: OOM or not, the probe reports and the search goes on
        result.status = classify_exception(exc)
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        result.error = text[-_ERROR_TAIL:]
        del exc  # its traceback holds the failing frames and their tensors
    else:
        result.measured_seconds = window
        result.step_seconds = window / measure_steps
        result.tokens_per_s = config.tokens_per_step / result.step_seconds
        result.samples_per_s = config.effective_batch / result.step_seconds
        peak = peak_flops(env.device_name, config.precision) if device.type == "cuda" else None
        if peak:
            result.mfu = result.tokens_per_s * flops_per_token(model, hf_config, config.block_size) / peak
    finally:
        _record_memory(result, device, accountant)
        if losses:
            result.first_loss, result.last_loss = losses[0], losses[-1]
        del model, optimizer, trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if result.status == "ok" and not all(math.isfinite(x) for x in losses):
        result.status, result.error = "unstable", f"non-finite loss in {sum(not math.isfinite(x) for x in losses)} of {len(losses)} steps"
    if result.status == "ok" and result.required_bytes is not None and result.required_bytes + margin_bytes > budget_bytes:
        # The allocator stayed under its cap, but the CUDA context grew while kernels loaded: on a
        # card of the budget's size this configuration would not have fitted.
        result.status = "oom"
        result.error = (f"peak reserved {result.peak_reserved_bytes} + context {result.context_bytes} + margin "
                        f"{margin_bytes} bytes exceed the {budget_bytes}-byte budget")
    return result


def _record_memory(result: ProbeResult, device: torch.device, accountant: CpuMemoryAccountant | None) -> None:
    if device.type == "cuda":
        result.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        result.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
        result.context_bytes = max(result.context_bytes or 0, measure_cuda_context(device))
    elif accountant is not None:
        result.peak_allocated_bytes = accountant.peak_allocated
        result.peak_reserved_bytes = accountant.peak_reserved


def serve(conn) -> None:
    """Worker main loop: answer requests on `conn` until told to stop or a probe ends unclean."""
    # The imports made ~10^6 long-lived objects; freezing them keeps each probe's full
    # gc.collect() (needed to free the last model before the next) at milliseconds, not ~0.4 s.
    gc.collect()
    gc.freeze()
    conn.send({"ready": True, "startup_seconds": _IMPORT_SECONDS})
    while True:
        try:
            request = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if request is None:
            return
        try:
            if request["op"] == "environment":
                conn.send({"environment": describe(resolve_device(request["device"])).to_dict()})
                continue
            result = run_probe_in_process(request)
        except AutotuneError as exc:
            conn.send({"user_error": type(exc).__name__, "message": str(exc)})
            continue
        conn.send({"result": result.to_dict()})
        if result.status not in ("ok", "skipped"):
            return  # after an OOM or a fault, this process's allocator or context cannot be trusted


def main(conn) -> None:  # the spawn target
    # Ctrl-C goes to the whole process group; the parent decides when a probe stops, so the
    # worker ignores SIGINT and finishes (or is killed by) the parent instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(conn)
    finally:
        conn.close()
