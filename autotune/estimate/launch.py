"""Running the trace child: `python -m autotune.estimate.trace`, one process for a whole request,
so that torch and transformers are imported once. Failures of the child become `EstimateError`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.errors import AutotuneError
from autotune.estimate.protocol import TraceFailure, TraceRequest, TraceResult, read_answer


class EstimateError(AutotuneError):
    """The configuration could not be traced (the trace child failed, crashed or timed out)."""


def _describe(config: ProbeConfig) -> str:
    return f"{config.model} {config.label()}"


def trace_in_child(request: TraceRequest, timeout: float) -> list[TraceResult]:
    """The child's results for every item of `request`, in order; `timeout` seconds per item."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    # The child must import this very autotune, also when it runs from a checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    limit = timeout * len(request.items)
    returncode: int | None
    try:
        proc = subprocess.run([sys.executable, "-m", "autotune.estimate.trace"], input=request.to_json(),
                              capture_output=True, text=True, timeout=limit, env=env)
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the child
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, returncode = "", None
    results: list[TraceResult] = []
    for line in stdout.splitlines():
        answer = read_answer(line)
        if isinstance(answer, TraceFailure):
            raise EstimateError(f"could not trace {_describe(request.items[answer.index].config)}: {answer.message}; "
                                f"probe the configuration instead.")
        if answer is not None:
            results.append(answer)
    if len(results) == len(request.items):
        return results
    what = _describe(request.items[len(results)].config)  # the item the child was tracing when it stopped
    if returncode is None:
        raise EstimateError(f"estimating {what} took longer than {timeout:.0f} s and was stopped; "
                            f"allow more time (--timeout) or probe the configuration instead.")
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit status {returncode}"
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["no message"]
    raise EstimateError(f"the estimator's process died while tracing {what} ({how}: {tail[0][:300]}); "
                        f"probe the configuration instead.")
