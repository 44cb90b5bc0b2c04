"""Tiny models for tests: config.json directories (memory and speed need no weights) and whether a
CUDA device is at hand."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# A 2-layer GPT-2, small enough that a CPU probe takes about a second of steps.
TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 1024,
    "n_positions": 256,
    "n_ctx": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def write_model_dir(path: Path, **overrides) -> Path:
    """`path`, holding only the config.json of the tiny GPT-2 with `overrides`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_GPT2, **overrides}))
    return path


def cuda_available() -> bool:
    # Ask torch only when a driver is visible: importing torch costs seconds.
    if not (shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia")):
        return False
    import torch

    return torch.cuda.is_available()


# A model type transformers does not ship, with its configuration and modeling code beside config.json.
CONFIGURATION = """from transformers import GPT2Config


class RemoteGPT2Config(GPT2Config):
    model_type = "remote-gpt2"
"""
MODELING = """from transformers import GPT2LMHeadModel

from .configuration_remote import RemoteGPT2Config


class RemoteGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = RemoteGPT2Config
"""


def write_remote_model(path: Path, modeling: str = MODELING) -> Path:
    """`path`: a tiny GPT-2 config under the remote-gpt2 type, with its configuration and `modeling` code."""
    path.mkdir()
    config = {
        **TINY_GPT2,
        "model_type": "remote-gpt2",
        "architectures": ["RemoteGPT2LMHeadModel"],
        "auto_map": {
            "AutoConfig": "configuration_remote.RemoteGPT2Config",
            "AutoModelForCausalLM": "modeling_remote.RemoteGPT2LMHeadModel",
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_remote.py").write_text(CONFIGURATION)
    (path / "modeling_remote.py").write_text(modeling)
    return path
