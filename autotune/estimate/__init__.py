"""Predict a training configuration's memory without a GPU, before probing it.

`estimate_memory(config)` traces the probe's own build and two optimizer steps (forward,
backward, AdamW step, `zero_grad(set_to_none=True)`) on fake tensors in a child process, then
replays the allocations: the peak allocated and what was live at that moment (parameters,
gradients, optimizer state, activations, temporaries), and, for CUDA, what the caching allocator
would have reserved. Nothing is allocated for real. See `trace.py` for the tracing, `cuda.py` for
how a CPU trace is made to allocate what a CUDA run allocates, `allocator.py` for the reserved
memory.

Importing this module does not import torch: the search imports it to skip configurations
predicted not to fit and to order probes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autotune import __version__
from autotune.config import ProbeConfig
from autotune.environment import package_version
from autotune.errors import AutotuneError, BadInput
from autotune.models import ModelSpec, resolve_model
from autotune.units import format_size

__all__ = [
    "CUBLAS_WORKSPACE_BYTES", "CUDA_CONTEXT_BYTES", "DEVICE_TYPES", "EstimateError", "MemoryEstimate",
    "estimate_memories", "estimate_memory", "margin_bytes", "render_estimate",
]

DEVICE_TYPES = ("cuda", "cpu")
# Memory a CUDA process holds outside PyTorch's allocator: the context with its loaded kernels
# (0.3-0.7 GiB depending on driver, card and libraries; DESIGN.md). Assumed, not measured: a probe
# measures the real figure on its card. 0 on CPU.
CUDA_CONTEXT_BYTES = 500 * 2**20
# cuBLAS workspaces, taken from the caching allocator and held for the whole run, so they count as
# allocated: one per (thread, stream) that runs matmuls, i.e. the training thread and autograd's
# device thread; 32 MiB each on Hopper and later (torch's default CUBLAS_WORKSPACE_CONFIG, 8 MiB +
# 128 KiB on older cards).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20
DEFAULT_TIMEOUT = 120.0
# How the child (`python -m autotune.estimate.trace`) marks its one line of answer on stdout.
RESULT_PREFIX = "AUTOTUNE-ESTIMATE-RESULT "
ERROR_PREFIX = "AUTOTUNE-ESTIMATE-ERROR "
# Bump when the estimator's method changes, so that cached estimates of the old method are not reused.
ESTIMATOR_VERSION = "e1"
_CACHE_ENTRIES = 512
_FLASH_FAMILY = ("flash_attention_2", "flash_attention_3")

RESERVED_METHOD = {
    "cuda": "CUDA caching allocator replayed over the traced allocations (default settings, one stream)",
    "cpu": "each storage rounded up to 512 bytes, as the probe's CPU accountant counts",
}


class EstimateError(AutotuneError):
    """The configuration could not be traced (the child failed, crashed or timed out)."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted memory of one configuration on one device type. Sizes in bytes.

    `params + grads + optimizer + activations + temporaries + workspace == peak_bytes`: what was
    live at the moment of the peak. `reserved_bytes` is what the allocator would hold at its peak
    (`torch.cuda.max_memory_reserved()`); `context_bytes` what the process needs outside it.
    """

    config: ProbeConfig
    device_type: str
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    workspace: int
    peak_bytes: int
    reserved_bytes: int
    context_bytes: int
    seconds: float                 # wall time of this call (near 0 when cached)
    trace_seconds: float = 0.0     # wall time of the trace that produced it
    peak_phase: str = ""           # where in the step the peak falls: forward, backward, optimizer step
    cached: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def breakdown(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "temporaries": self.temporaries, "workspace": self.workspace}

    @property
    def required_bytes(self) -> int:
        """What the configuration needs of the card: peak reserved plus the context."""
        return self.reserved_bytes + self.context_bytes

    @property
    def reserved_method(self) -> str:
        return RESERVED_METHOD[self.device_type]

    def headroom(self, budget_bytes: int, margin_bytes: int = 0) -> int:
        """Bytes to spare within the budget after the margin; negative when over."""
        return budget_bytes - margin_bytes - self.required_bytes

    def fits(self, budget_bytes: int, margin_bytes: int = 0) -> bool:
        """True if peak reserved + context + margin is within the budget (the probe's rule)."""
        return self.headroom(budget_bytes, margin_bytes) >= 0

    def exceeds(self, budget_bytes: int, by_more_than: int = 0) -> bool:
        """True if even the peak *allocated* plus the context is over the budget by more than
        `by_more_than` bytes: the test for skipping a configuration without probing it. Allocated
        memory is a floor (under a cap the allocator frees cached blocks before it fails, so the
        reserved figure, measured uncapped, can shrink; the allocated one cannot)."""
        return self.peak_bytes + self.context_bytes - budget_bytes > by_more_than

    def to_dict(self, budget_bytes: int | None = None, margin_bytes: int = 0) -> dict:
        data = {
            "model": self.config.model,
            "config": self.config.to_dict(),
            "device_type": self.device_type,
            "peak_bytes": self.peak_bytes,
            "breakdown": self.breakdown,
            "reserved_bytes": self.reserved_bytes,
            "reserved_method": self.reserved_method,
            "context_bytes": self.context_bytes,
            "required_bytes": self.required_bytes,
            "peak_phase": self.peak_phase,
            "seconds": round(self.seconds, 3),
            "trace_seconds": round(self.trace_seconds, 3),
            "cached": self.cached,
            "notes": list(self.notes),
        }
        if budget_bytes is not None:
            data.update(budget_bytes=budget_bytes, margin_bytes=margin_bytes, fits=self.fits(budget_bytes, margin_bytes),
                        headroom_bytes=self.headroom(budget_bytes, margin_bytes))
        return data

    def _cache_record(self) -> dict:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def _from_cache_record(cls, data: dict, seconds: float) -> "MemoryEstimate":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values.update(config=ProbeConfig.from_dict(data["config"]), notes=tuple(data.get("notes", ())),
                      seconds=seconds, cached=True)
        return cls(**values)


# -- validation, before any process starts ------------------------------------------------------

def _check(config: ProbeConfig, device_type: str, spec: ModelSpec) -> list[str]:
    """Raise BadInput for what the user must change; return notes on approximations."""
    if device_type not in DEVICE_TYPES:
        raise BadInput(f"--device-type {device_type!r} is unknown; choose cuda (predict a GPU run) or cpu (predict a CPU probe).")
    if spec.needs_remote_code:
        raise BadInput(f"--model {spec.reference} needs custom code (auto_map); the estimator builds only "
                       f"architectures transformers ships. Probe it instead.")
    if "vocab_size" not in spec.config:
        raise BadInput(f"--model {spec.reference}: its config has no vocab_size; the estimator handles causal language models.")
    if spec.max_positions is not None and config.block_size > spec.max_positions:
        raise BadInput(f"--block-size {config.block_size} is above {spec.reference}'s maximum of "
                       f"{spec.max_positions} positions; use at most {spec.max_positions}.")
    notes = []
    if config.attention in _FLASH_FAMILY or config.attention == "flex_attention":
        if device_type == "cpu":
            raise BadInput(f"--attention {config.attention} has no CPU kernel; use sdpa or eager with --device-type cpu.")
        if config.attention in _FLASH_FAMILY and config.precision == "fp32":
            raise BadInput(f"--attention {config.attention} runs only in fp16/bf16; use --precision bf16 or fp16, or --attention sdpa.")
        notes.append(f"{config.attention} approximated by SDPA's CUDA kernels (both keep no S x S matrix)")
    if device_type == "cuda":
        notes.append(f"CUDA context assumed {format_size(CUDA_CONTEXT_BYTES)} (not measured: a probe measures it on its card)")
        notes.append(f"cuBLAS workspaces assumed {format_size(CUBLAS_WORKSPACE_BYTES)} (Hopper and later; about 16 MiB on older cards)")
    return notes


# -- cache ----------------------------------------------------------------------------------------

def _cache_path() -> Path:
    home = os.environ.get("AUTOTUNE_HOME")
    if home:
        return Path(home).expanduser() / "cache" / "estimates.json"
    import platformdirs

    return Path(platformdirs.user_cache_dir("autotune")) / "estimates.json"


def cache_key(config: ProbeConfig, device_type: str, spec: ModelSpec) -> str:
    """Identity of an estimate: the configuration, the model's architecture, the device type and
    every version that can change the answer."""
    parts = {
        "config": config.key(), "model": spec.fingerprint, "device_type": device_type,
        "torch": package_version("torch"), "transformers": package_version("transformers"),
        "autotune": __version__, "estimator": ESTIMATOR_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: the cache only saves time, so start afresh
    return data if isinstance(data, dict) and data.get("version") == 1 else {}


def _write_cache(path: Path, key: str, record: dict) -> None:
    data = _read_cache(path)
    entries = data.get("entries", {})
    entries[key] = {"stored": time.time(), "estimate": record}
    if len(entries) > _CACHE_ENTRIES:  # keep the newest
        entries = dict(sorted(entries.items(), key=lambda kv: kv[1].get("stored", 0))[-_CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": 1, "entries": entries}))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only cache directory costs time, not correctness


# -- the child process --------------------------------------------------------------------------

def _describe(config: ProbeConfig) -> str:
    return f"{config.model} {config.label()}"


def _run_traces(device_type: str, items: list[dict], configs: list[ProbeConfig], timeout: float) -> list[dict]:
    """Trace `items` in one child process (torch and transformers are imported once)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    request = {"device_type": device_type, "items": items}
    limit = timeout * len(items)
    try:
        proc = subprocess.run([sys.executable, "-m", "autotune.estimate.trace"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=limit, env=env)
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the child
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, returncode = "", None
    results: list[dict] = []
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            results.append(json.loads(line[len(RESULT_PREFIX):]))
        elif line.startswith(ERROR_PREFIX):
            err = json.loads(line[len(ERROR_PREFIX):])
            raise EstimateError(f"could not trace {_describe(configs[err['index']])}: {err['message']}; "
                                f"probe the configuration instead.")
    if len(results) == len(items):
        return results
    what = _describe(configs[len(results)])
    if returncode is None:
        raise EstimateError(f"estimating {what} took longer than {timeout:.0f} s and was stopped; "
                            f"allow more time (--timeout) or probe the configuration instead.")
    if returncode < 0:
        import signal

        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit status {returncode}"
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["no message"]
    raise EstimateError(f"the estimator's process died while tracing {what} ({how}: {tail[0][:300]}); "
                        f"probe the configuration instead.")


def estimate_memory(config: ProbeConfig, *, device_type: str = "cuda", timeout: float = DEFAULT_TIMEOUT,
                    use_cache: bool = True) -> MemoryEstimate:
    """Predict the peak memory of training `config`, as a probe on `device_type` would measure it.

    `device_type="cuda"` (the default) predicts a CUDA run: fused dropout masks, SDPA's flash and
    memory-efficient kernels, CUDA's autocast op lists, the caching allocator's reserved memory,
    cuBLAS workspaces and an assumed CUDA context. `"cpu"` predicts what the CPU probe accounts.
    Raises BadInput/ModelNotFound for input the user must fix (checked before any process starts)
    and EstimateError when tracing fails or takes longer than `timeout` seconds; repeats come from
    a cache under $AUTOTUNE_HOME.
    """
    return estimate_memories([config], device_type=device_type, timeout=timeout, use_cache=use_cache)[0]


def estimate_memories(configs: list[ProbeConfig], *, device_type: str = "cuda", timeout: float = DEFAULT_TIMEOUT,
                      use_cache: bool = True) -> list[MemoryEstimate]:
    """`estimate_memory` for several configurations, traced in one child process (about 3 s of
    imports saved per configuration); `timeout` applies to each. In the order given."""
    started = time.perf_counter()
    if not timeout or timeout <= 0:
        raise BadInput(f"--timeout must be a positive number of seconds (got {timeout!r}).")
    specs: dict[str, ModelSpec] = {}
    plans = []
    for config in configs:
        if not isinstance(config, ProbeConfig):
            raise TypeError(f"config must be a ProbeConfig, not {type(config).__name__}")
        spec = specs.get(config.model) or resolve_model(config.model)
        specs[config.model] = spec
        plans.append((config, spec, _check(config, device_type, spec), cache_key(config, device_type, spec)))

    path = _cache_path()
    cached = _read_cache(path).get("entries", {}) if use_cache else {}
    out: list[MemoryEstimate | None] = [None] * len(plans)
    todo = []
    for i, (config, spec, notes, key) in enumerate(plans):
        hit = cached.get(key)
        if hit is not None:
            try:
                out[i] = MemoryEstimate._from_cache_record(hit["estimate"], time.perf_counter() - started)
                continue
            except (KeyError, TypeError, ValueError, AutotuneError):
                pass  # a record of another shape: trace again
        todo.append(i)

    if todo:
        items = []
        for i in todo:
            config, spec = plans[i][0], plans[i][1]
            item = {"config": config.to_dict(), "model_config": spec.config, "model_path": spec.path}
            if config.attention in _FLASH_FAMILY or config.attention == "flex_attention":
                item["trace_attention"] = "sdpa"
            items.append(item)
        traced_at = time.perf_counter()
        results = _run_traces(device_type, items, [plans[i][0] for i in todo], timeout)
        per_config = (time.perf_counter() - traced_at) / len(todo)
        cuda = device_type == "cuda"
        workspace = CUBLAS_WORKSPACE_BYTES if cuda else 0
        for i, result in zip(todo, results):
            config, _, notes, key = plans[i]
            parts = result["breakdown"]
            estimate = MemoryEstimate(
                config=config, device_type=device_type,
                params=parts["params"], grads=parts["grads"], optimizer=parts["optimizer"],
                activations=parts["activations"], temporaries=parts["temporaries"], workspace=workspace,
                peak_bytes=result["peak_bytes"] + workspace,
                reserved_bytes=result["reserved_bytes"] + workspace,  # the workspaces are segments of their own
                context_bytes=CUDA_CONTEXT_BYTES if cuda else 0,
                seconds=time.perf_counter() - started,
                trace_seconds=per_config,
                peak_phase=result.get("peak_phase", ""),
                notes=tuple(notes),
            )
            out[i] = estimate
            if use_cache:
                _write_cache(path, key, estimate._cache_record())
    return [e for e in out if e is not None]


def margin_bytes(margin: int | float, budget_bytes: int) -> int:
    """A safety margin in bytes: `margin` is bytes, or a fraction of the budget when below 1
    (as `autotune.units.parse_margin` returns it and the probe applies it)."""
    return int(margin * budget_bytes) if margin < 1 else int(margin)


# -- presentation -------------------------------------------------------------------------------

def render_estimate(estimate: MemoryEstimate, budget_bytes: int | None = None, margin_bytes: int = 0) -> str:
    """The table `autotune estimate` prints."""
    e = estimate
    peak = e.peak_bytes or 1

    def row(label: str, value: int, share: bool = True, note: str = "") -> str:
        pct = f"{100 * value / peak:5.1f}%" if share else "      "
        return f"  {label:<24}{format_size(value):>12}  {pct}  {note}".rstrip()

    where = f"predicted for {e.device_type}, " + ("from the cache" if e.cached else f"traced in {e.trace_seconds:.1f} s")
    lines = [f"{e.config.model}  {e.config.label()}  ({where})", ""]
    lines.append(row("parameters", e.params))
    lines.append(row("gradients", e.grads))
    lines.append(row("optimizer state", e.optimizer))
    lines.append(row("activations", e.activations))
    lines.append(row("temporaries", e.temporaries))
    if e.device_type == "cuda":
        lines.append(row("cuBLAS workspaces", e.workspace))
    lines.append(row("peak allocated", e.peak_bytes, note=f"at the peak: {e.peak_phase}" if e.peak_phase else ""))
    over = e.reserved_bytes - e.peak_bytes
    lines.append(row("peak reserved", e.reserved_bytes, share=False,
                     note=f"+{format_size(over)} allocator overhead" if e.device_type == "cuda" else "512-byte rounding"))
    if e.device_type == "cuda":
        lines.append(row("CUDA context", e.context_bytes, share=False, note="assumed"))
        lines.append(row("needed on the card", e.required_bytes, share=False, note="reserved + context"))
    if budget_bytes is not None:
        lines.append("")
        room = e.headroom(budget_bytes, margin_bytes)
        margin_text = f" with a {format_size(margin_bytes)} margin" if margin_bytes else ""
        if room >= 0:
            lines.append(f"  budget {format_size(budget_bytes)}{margin_text}: fits, {format_size(room)} to spare")
        else:
            lines.append(f"  budget {format_size(budget_bytes)}{margin_text}: does NOT fit, {format_size(-room)} over")
    if e.notes:
        lines.append("")
        lines.extend(f"  note: {n}" for n in e.notes)
    return "\n".join(lines)
