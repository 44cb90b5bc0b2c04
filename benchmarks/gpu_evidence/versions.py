"""The versions section (pass 1): the packages the evidence depends on (imported on a card, read from
their installed metadata on CPU), the machine's own versions of what the carried wheels may shadow,
and what nvidia-smi says about the card. Its helper runs in a child, as every import of torch does.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from autotune.host.environment import package_version
from benchmarks.gpu_evidence.common import last_line, one_line
from benchmarks.gpu_evidence.invocation import Run

PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "tokenizers",
    "optuna",
    "sqlalchemy",
    "alembic",
    "datasets",
    "peft",
    "bitsandbytes",
    "liger_kernel",
    "pynvml",
)
IMAGE_VERSIONS = (
    "import importlib.metadata as m, json\n"
    "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
    "print(json.dumps({n: v(n) for n in ('pyarrow', 'datasets', 'pandas', 'torch', 'transformers')}))"
)


def section_versions(run: Run) -> dict:
    """Versions of what the evidence depends on, and what nvidia-smi says about the card."""
    # On CPU an import says nothing about CUDA libraries and costs 7 s of the CPU mode's minute
    # (peft, bitsandbytes): there the versions come from the installed metadata.
    figures: dict[str, Any] = {"packages": run.helper("versions", timeout=180, packages=list(PACKAGES), load=run.cuda)}
    # The machine's own versions of what the carried wheels may shadow (datasets 5 needs pyarrow >= 24):
    # whether the next session must carry them.
    image = run.command([run.python, "-c", IMAGE_VERSIONS], timeout=60, env={"PYTHONPATH": None})
    figures["image_packages"] = (
        json.loads(image.stdout.strip().splitlines()[-1])
        if image.returncode == 0
        else {"error": last_line(image.stdout)}
    )
    if shutil.which("nvidia-smi") is None:
        figures["nvidia_smi"] = "skipped: nvidia-smi not found"
    else:
        query = run.command(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
            timeout=60,
        )
        full = run.command(["nvidia-smi"], timeout=60)
        figures["nvidia_smi"] = {
            "query": query.stdout.strip(),
            "output": full.stdout.strip(),
            "exit_status": full.returncode,
        }
    return figures


def helper_versions(packages: list[str], load: bool) -> dict:
    """Each package's version, imported (`load`) or from its installed metadata; "missing: why" if not."""
    import importlib.util

    found: dict[str, str] = {}
    for name in packages:
        if not load:
            found[name] = (
                package_version(name.replace("_", "-"))
                or package_version(name)
                or ("installed, no version" if importlib.util.find_spec(name) else "missing: not installed")
            )
            continue
        try:
            module = importlib.import_module(name)
        except (
            Exception
        ) as exc:  # a package that fails to import is the finding (bitsandbytes without its CUDA library)
            found[name] = f"missing: {type(exc).__name__}: {one_line(str(exc), 200)}"
            continue
        found[name] = str(getattr(module, "__version__", None) or package_version(name) or "imported, no version")
    return found
