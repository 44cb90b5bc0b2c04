"""The training step a probe measures: the model as a probe builds it, its optimizer, and one
optimizer step. The probe child runs it for real; the estimator traces the same code on fake
tensors, so that an estimate follows the probe whenever this file changes."""

from __future__ import annotations

import contextlib

import torch

from autotune.config import ProbeConfig
from autotune.models import ModelSpec


def build_model(model_config: dict, model_path: str | None, config: ProbeConfig, device: torch.device,
                trust_remote_code: bool):
    """A randomly initialised causal LM built directly on `device`; memory and speed do not depend
    on the weights' values, so no checkpoint is read. Returns (model, transformers config)."""
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


class ProbeStep:
    """One optimizer step of a probe: `grad_accum` micro-steps, then the optimizer."""

    def __init__(self, model, optimizer, config: ProbeConfig, device: torch.device, vocab_size: int):
        self.model, self.optimizer, self.config, self.device = model, optimizer, config, device
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        # Two synthetic batches of the right shape and vocabulary, alternated: like a data loader's
        # prefetched batch, they are part of the memory a real run holds.
        shape = (config.micro_batch, config.block_size)
        self.batches = [torch.randint(0, vocab_size, shape, device=device) for _ in range(2)]

    def __call__(self) -> float:
        """Run the step; returns its loss (summed over micro-steps)."""
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.config.grad_accum):
            input_ids = self.batches[micro % 2]
            with self.autocast():
                loss = self.model(input_ids=input_ids, labels=input_ids).loss / self.config.grad_accum
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
