"""The training step a probe measures: the model as a probe builds it, its optimizer, and one
optimizer step. The probe child runs it for real; the estimator traces the same code on fake
tensors, so that an estimate follows the probe whenever this file changes."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math

import torch

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.specs.flops import flops_per_token
from autotune.specs.models import ModelSpec
from autotune.levers.recipes import OPTIMIZERS, PEFT_TASK_TYPES, PeftSpec, is_qlora
from autotune.probe.batches import drawn_batch, synthetic_batch
from autotune.levers.tasks import AUTO_CLASSES, Task

# bitsandbytes (imported by peft and by transformers' optimizers) warns on import about optional
# CPU kernels nobody asked for: on a user error that would be a second line before the one that matters.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def auto_class(task: str):
    """The transformers Auto class that builds `task`'s model."""
    import transformers

    return getattr(transformers, AUTO_CLASSES[Task(task)])


def task_config(hf_config, config: ProbeConfig):
    """The transformers config as the task trains it (changed in place, and returned)."""
    hf_config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if config.num_labels is not None:
        hf_config.num_labels = config.num_labels
    if config.task == Task.CLASSIFICATION and getattr(hf_config, "pad_token_id", None) is None:
        # Decoder classifiers (GPT2ForSequenceClassification) find each sequence's last token by
        # its padding and refuse batches of several without a pad token; run_classification.py
        # sets it to the end-of-text token the same way.
        hf_config.pad_token_id = getattr(hf_config, "eos_token_id", None) or 0
    if config.task == Task.SEQ2SEQ and getattr(hf_config, "decoder_start_token_id", None) is None:
        # The decoder's inputs are the labels shifted right behind this token. transformers 5.24's
        # T5Config(...) no longer has one (T5's _shift_right then fails with AttributeError); start
        # as transformers' own seq2seq training and generation fall back: the pad token (T5's
        # convention), else the bos token, else 0.
        pad, bos = getattr(hf_config, "pad_token_id", None), getattr(hf_config, "bos_token_id", None)
        hf_config.decoder_start_token_id = pad if pad is not None else bos if bos is not None else 0
    return hf_config


def from_config(hf_config, config: ProbeConfig, trust_remote_code: bool, **kwargs):
    """`config.task`'s model built from `hf_config`: BadInput when transformers has no class of that
    task for this model type (one line, rather than transformers' list of every class it knows)."""
    cls = auto_class(config.task)
    try:
        return cls.from_config(
            hf_config, attn_implementation=config.attention, trust_remote_code=trust_remote_code, **kwargs
        )
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise BadInput(
            f"the model ({hf_config.model_type}) has no {config.task} class in transformers ({cls.__name__} "
            f"does not know model type {hf_config.model_type!r}); pass the --task it is made for."
        ) from None


def build_random_model(spec: ModelSpec, config: ProbeConfig, device: torch.device, trust_remote_code: bool):
    """A randomly initialised model of `config.task`'s class (all its parameters: an encoder-decoder
    is built whole), directly on `device`; memory and speed do not depend on the weights' values,
    so no checkpoint is read. Returns (model, transformers config)."""
    hf_config = task_config(spec.hf_config(trust_remote_code), config)
    # fp32 master weights whatever dtype the checkpoint was saved in: mixed precision is autocast
    # over fp32 weights, as Trainer does with fp16=True/bf16=True. Pure bf16 (--weights bf16) is the
    # model loaded with dtype=torch.bfloat16.
    dtype = weights_dtype(config)
    if is_qlora(config.peft):  # the linear layers in 4 bits, the rest in `dtype`
        from autotune.probe.qlora import build_4bit

        model = build_4bit(
            lambda: from_config(hf_config, config, trust_remote_code, dtype=dtype), config, device, dtype
        )
    else:
        with torch.device(device):
            model = from_config(hf_config, config, trust_remote_code, dtype=dtype)
    model.train()
    if config.checkpointing:
        # Non-reentrant checkpointing is what PyTorch recommends and what Trainer uses by default.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if config.peft is not None:
        # Made where the model is (peft moves each adapter to its base layer's device otherwise): on
        # the meta device under FSDP, sharded before it gets memory, where the estimator's fake
        # tensors could not be moved.
        with torch.device(device):
            model = with_adapters(model, config)
    return model, hf_config


def weights_dtype(config: ProbeConfig) -> torch.dtype:
    return torch.bfloat16 if config.weights == "bf16" else torch.float32


def lora_config(config: ProbeConfig):
    """The `peft.LoraConfig` of `config.peft` (BadInput when peft is not installed)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise BadInput("--peft needs the peft package: pip install 'autotune[peft]' (or pip install peft).") from None
    assert config.peft is not None
    spec = PeftSpec.from_text(config.peft)
    return LoraConfig(task_type=PEFT_TASK_TYPES.get(config.task), **spec.lora_kwargs())


def with_adapters(model, config: ProbeConfig):
    """`model` with LoRA adapters on its frozen base (peft): only the adapters (and a classifier's
    head) train, so the base has no gradients and no optimizer state."""
    from peft import get_peft_model

    lora = lora_config(config)
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if "target" in text.lower() or "not found" in text.lower():
            raise BadInput(
                f"--lora-targets {PeftSpec.from_text(config.peft or '').targets}: {text[:300]}; name modules "
                f"of this model (e.g. q_proj,v_proj or c_attn) or use all-linear."
            ) from None
        raise


def import_recipe_code(config: ProbeConfig) -> None:
    """Import what building `config` imports beyond the model (peft for LoRA; transformers'
    optimizers, which import peft and bitsandbytes, for Adafactor): before a probe's accountant or
    the estimator's ledger starts counting, since those imports make tensors that live on (16
    bytes, counted as the probe's), and only for the configs that need them (seconds each)."""
    if config.peft is not None:
        import peft  # noqa: F401
    if is_qlora(config.peft):
        from autotune.probe.qlora import import_quantizer

        import_quantizer()
    if config.optimizer == "adafactor":
        import transformers.optimization  # noqa: F401
    if config.trainer == "trl":
        import trl.trainer.utils  # noqa: F401
    if OPTIMIZERS[config.optimizer].needs == "bitsandbytes":
        with contextlib.suppress(ImportError):  # (reported as the probe's skip reason)
            import bitsandbytes  # noqa: F401


def check_recipe(config: ProbeConfig, device: torch.device) -> None:
    """BadInput for a recipe this machine cannot train at all: PEFT without peft installed, QLoRA
    (a 4-bit base through bitsandbytes) without bitsandbytes or CUDA. (bitsandbytes also has CPU
    kernels for 4 bits, and tests build QLoRA's base on CPU with this check lifted; but a QLoRA
    fine-tune is a GPU's job, and what its probe measured on a CPU would tell no card anything.)
    `--trainer trl` needs trl: its step is TRL's own fused LM head."""
    if config.trainer == "trl" and importlib.util.find_spec("trl") is None:
        raise BadInput(
            "--trainer trl times TRL's SFTTrainer step, which needs trl: pip install trl (or --trainer transformers)."
        )
    if config.peft is None:
        return
    lora_config(config)  # (peft installed)
    if is_qlora(config.peft):
        if importlib.util.find_spec("bitsandbytes") is None:
            raise BadInput("--peft qlora needs bitsandbytes: pip install bitsandbytes, or use --peft lora.")
        if device.type != "cuda":
            raise BadInput(
                "--peft qlora quantizes the base to 4 bits for a GPU: it needs a CUDA device; use --peft lora "
                "(with --weights bf16 for a lean base) here, or estimate --peft qlora for a card."
            )


class OptimizerUnavailable(Exception):
    """The optimizer cannot run here (a package or a device kernel is missing): its probe is skipped."""


def make_optimizer(
    model, device: torch.device, name: str = "adamw", device_type: str | None = None
) -> torch.optim.Optimizer:
    """The optimizer `name` (autotune.levers.recipes.OPTIMIZERS) over the trainable parameters, as Trainer
    makes it for the matching `optim`: AdamW fused where the device has the kernel, torch's
    default AdamW (foreach on CUDA, as torch picks it for CUDA tensors; the single-tensor loop on
    a CPU), Adafactor with scale_parameter and relative_step off, SGD with momentum 0.9,
    bitsandbytes' 8-bit AdamW. `device_type` is the device the run is for, where it differs from
    `device` (the estimator traces a CUDA run on CPU fake tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw_torch":
        return torch.optim.AdamW(params, lr=5e-5, foreach=(device_type or device.type) == "cuda")
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=5e-5, momentum=0.9)
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        if name.startswith("paged") and device.type != "cuda":
            raise OptimizerUnavailable(f"{name} pages its state through CUDA unified memory: CUDA only")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise OptimizerUnavailable(f"{name} needs bitsandbytes (pip install bitsandbytes)") from None
        return (bnb.optim.PagedAdamW8bit if name.startswith("paged") else bnb.optim.AdamW8bit)(params, lr=5e-5)
    try:
        return torch.optim.AdamW(params, lr=5e-5, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=5e-5, foreach=device.type == "cuda")


def parameter_count(model, trainable: bool = False) -> int:
    """The model's parameters (only those that train, with `trainable`), a 4-bit weight counted as
    the values it holds rather than its packed bytes (two values to a byte)."""

    def values(p) -> int:
        state = getattr(p, "quant_state", None) if getattr(p, "bnb_quantized", False) else None
        return math.prod(state.shape) if state is not None else p.numel()

    return sum(values(p) for p in model.parameters() if p.requires_grad or not trainable)


def model_flops_per_token(model, hf_config, config: ProbeConfig) -> float:
    """Useful training FLOPs per token of the model built (autotune.specs.flops, as the planner counts
    them: a frozen LoRA base has no weight gradients), for MFU: no recomputation."""
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    hidden = getattr(hf_config, "hidden_size", 0) or 0
    return flops_per_token(
        parameter_count(model), parameter_count(model, trainable=True), layers, hidden, config.block_size
    )


def deferred_sync(model):
    """A context for the micro-steps before the last of an optimizer step on several ranks: the
    gradients stay on each rank and the last micro-step synchronises them (Trainer's
    `accelerator.no_sync`): DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`."""
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module

        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return no_sync
    return getattr(model, "no_sync", None)  # DistributedDataParallel's


# What transformers' Trainer does around each micro-step and optimizer step besides the model's own
# work, at its defaults (TrainingArguments: max_grad_norm 1.0, logging_nan_inf_filter on, a linear
# schedule; read from Trainer._inner_training_loop, transformers 5.24). Trainer is what the hand-off
# runs (and TRL's, axolotl's and LLaMA-Factory's trainers subclass it), so the probe times it too
# (issue 56): on a card the loss's finiteness read waits for the card every micro-step, which a bare
# step does not.
TRAINER_MAX_GRAD_NORM = 1.0
TRAINER_SCHEDULE_STEPS = 1000  # the linear schedule's length: its value changes nothing timed


class TrlLoss:
    """TRL's SFTTrainer's loss, as its `compute_loss` runs it (TRL 1.16, trainer/sft_trainer.py): the
    model patched with TRL's own fused LM head (`add_fused_lm_head`, from the installed trl, with the
    outputs SFTTrainer asks for), which scores the log-probabilities in chunks without the full
    logits and also each token's entropy and whether its top-1 is right; then, before the backward,
    the metrics SFTTrainer logs read to the host: tokens scored (`num_valid > 0`), mean entropy, token
    accuracy and, where the batch has a mask, its tokens. Those reads wait for the forward, every
    micro-step: on a card the host can no longer run ahead."""

    OUTPUTS = ("log_probs", "entropy", "is_top1")  # SFTTrainer's: `is_top1` feeds mean_token_accuracy

    def __init__(self, model) -> None:
        from trl.trainer.utils import add_fused_lm_head

        # SFTTrainer patches the base model under PEFT's wrapper, and the module a DDP wrapper holds.
        target = model.module if hasattr(model, "module") else model
        add_fused_lm_head(
            target.get_base_model() if hasattr(target, "get_base_model") else target, outputs=self.OUTPUTS
        )

    def __call__(self, forward, batch: dict, reads_values: bool) -> torch.Tensor:
        outputs = forward(**batch, fused_lm_head=True)  # (which turns the cache off, as SFTTrainer does)
        loss = -outputs.log_probs.sum() / outputs.label_mask.sum().clamp(min=1)
        if reads_values:
            num_valid = outputs.label_mask.sum()
            entropy_sum, num_correct = outputs.entropy.detach().sum(), outputs.is_top1.sum()
            if num_valid > 0:
                (entropy_sum / num_valid).item()
                (num_correct / num_valid).item()
            if "attention_mask" in batch:
                batch["attention_mask"].sum().item()
        return loss


class ProbeStep:
    """One optimizer step of a probe as Trainer runs it: `grad_accum` micro-steps, each followed by
    Trainer's check that the loss is finite (a read of its value); then, on one rank, the gradients
    clipped to TRAINER_MAX_GRAD_NORM, the optimizer, the learning-rate schedule and zeroed
    gradients. With `config.trainer` "trl", each micro-step's loss is TRL's SFTTrainer's (TrlLoss).
    `reads_values`: False where the step is traced on fake tensors (the estimator), whose values
    cannot be read; what the reads hold is a few scalars."""

    def __init__(
        self, model, optimizer, config: ProbeConfig, device: torch.device, vocab_size: int, reads_values: bool = True
    ):
        self.model, self.optimizer, self.config, self.device = model, optimizer, config, device
        self.reads_values = reads_values
        # Trainer's clip and finiteness read on one rank only: on several, clipping sharded gradients
        # takes a collective of its own (left to a later change).
        self.trainer_extras = config.ranks == 1
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: max(0.0, 1 - step / TRAINER_SCHEDULE_STEPS)
        )
        self.forward = model  # compile_forward() swaps in the compiled model (--compile)
        self.trl_loss = TrlLoss(model) if config.trainer == "trl" else None
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        # Two synthetic batches of the task's shape and vocabulary, alternated: like a data loader's
        # prefetched batch, they are part of the memory a real run holds. With the data's lengths
        # (autotune.levers.lengths) these are its worst batch, which memory is measured on; the timed window
        # then draws its batches from the lengths (time_drawn_batches).
        self.vocab_size = vocab_size
        self.batches = [synthetic_batch(config, vocab_size, device) for _ in range(2)]
        self.drawn: list[dict[str, torch.Tensor]] | None = None
        self.next_drawn = 0
        # On several ranks the micro-steps before the last keep their gradients on the rank, and the
        # last one synchronises them (as Trainer does with accelerate's no_sync).
        self.deferred_sync = deferred_sync(model) if config.ranks > 1 else None

    def draw_cycle(self, cycle: int) -> None:
        """The micro-batches of the timed window's `cycle`-th cycle (autotune.levers.lengths.cycle_steps
        steps), drawn from the data's lengths: the steps after this take them in order."""
        from autotune.levers.lengths import timing_rows

        config = self.config
        assert config.lengths is not None  # (a window of drawn batches is timed for the data's lengths only)
        rows = timing_rows(
            config.lengths, config.micro_batch, config.rows_per_step, config.block_size, cycle, config.sampling
        )
        self.drawn = [
            drawn_batch(config, rows[i : i + config.micro_batch], self.vocab_size, self.device)
            for i in range(0, len(rows), config.micro_batch)
        ]
        self.next_drawn = 0

    def _batch(self, micro: int) -> dict[str, torch.Tensor]:
        if self.drawn is None:
            return self.batches[micro % 2]
        batch = self.drawn[self.next_drawn % len(self.drawn)]
        self.next_drawn += 1
        return batch

    def compile_forward(self) -> None:
        """Run the model compiled from the next step on (the first compiled step compiles it)."""
        from autotune.probe.speedups import compiled

        self.forward = compiled(self.model)

    def __call__(self) -> float:
        """Run the step; returns its loss (summed over micro-steps)."""
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.config.grad_accum):
            last = micro == self.config.grad_accum - 1
            with self.deferred_sync() if self.deferred_sync is not None and not last else contextlib.nullcontext():
                with self.autocast():
                    batch = self._batch(micro)
                    if self.trl_loss is not None:
                        loss = self.trl_loss(self.forward, batch, self.reads_values) / self.config.grad_accum
                    else:
                        loss = self.forward(**batch).loss / self.config.grad_accum
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            step_loss = loss.detach()
            if self.reads_values and self.trainer_extras:
                # Trainer's logging_nan_inf_filter: `torch.isnan(loss) or torch.isinf(loss)`, a host
                # sync each micro-step.
                bool(torch.isnan(step_loss) or torch.isinf(step_loss))
            loss_sum += step_loss
        if self.trainer_extras:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # (accelerate's clip_grad_norm_ unscales first)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), TRAINER_MAX_GRAD_NORM)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.item())  # one host sync per optimizer step, as a training loop's logging does
