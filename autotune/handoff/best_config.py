"""`BestConfig`: a study's winner in every form a fine-tune consumes (TrainingArguments' keyword
arguments, the model's loading arguments, the example scripts' flags, accelerate's file, YAML/JSON),
and `best()`, which reads it from the store. The package's front door (handoff/__init__.py) says
how to use it."""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from autotune.levers import evaluation
from autotune.levers import speed_levers
from autotune.results import verdict
from autotune.vocabulary import yaml_text
from autotune.results.budget import Budget, required_bytes
from autotune.host.environment import openmp_of, openmp_text
from autotune.vocabulary.errors import BadInput, StudyNotFound
import autotune.handoff.later_phases as later_phases
import autotune.handoff.loss_scaling as loss_scaling
import autotune.handoff.ranks as ranks
import autotune.handoff.scripts as scripts
import autotune.handoff.tools as tools
from autotune.handoff.argument_names import checkpointing_argument_names, sampling_arguments
from autotune.levers.recipes import (
    DEFAULT_TRAINER,
    OPTIMIZERS,
    PEFT_TASK_TYPES,
    PeftSpec,
    bnb_4bit_kwargs,
    is_qlora,
    memory_caveats,
)
from autotune.vocabulary.status import ProbeStatus, StudyStatus
from autotune.store import LeaderboardRow, ProbeRecord, StudyRecord, open_store
from autotune.levers.tasks import AUTO_CLASSES, EXAMPLE_SCRIPTS, MLM_PROBABILITY, Task
from autotune.vocabulary.units import format_size

_HUB_ARGUMENTS = (
    "revision",
    "token",
    "cache_dir",
    "local_files_only",
    "trust_remote_code",
    "subfolder",
    "force_download",
    "proxies",
)


@dataclass(frozen=True, slots=True)
class BestConfig:
    row: LeaderboardRow
    device_type: str = "cuda"  # where the study measured: a CPU study hands off to a CPU run
    confirmation: dict | None = None  # the study's confirmation round (search/confirm.py), if one ran
    openmp: tuple[tuple[str, str], ...] = ()  # the OpenMP settings its probes ran under (Environment.openmp)
    device_name: str | None = None  # the device the study measured on ('NVIDIA A100-SXM4-80GB', 'cpu: ...')

    @property
    def config(self):
        return self.row.config

    # What a training script reads besides TrainingArguments, without reaching into `config`.
    @property
    def block_size(self) -> int:
        """Tokens per sequence (seq2seq: source tokens; classification and masked LM: max_seq_length)."""
        return self.config.block_size

    @property
    def target_length(self) -> int | None:
        """seq2seq: target tokens (max_target_length); None for the other tasks."""
        return self.config.target_length

    @property
    def eval_batch(self) -> int | None:
        """The run's per_device_eval_batch_size (None: the study measured no evaluation): for
        `--eval-batch auto`, the largest its probe found to fit; else the config's."""
        found = self.row.eval_batch_found
        return found if found and self.config.auto_eval_batch else self.config.eval_batch

    @property
    def task(self) -> str:
        return self.config.task

    @property
    def confirmed(self) -> bool:
        """Told apart from the configs within noise of it by measuring them again (False: a tie, or no
        confirmation round ran, or the round chose another config)."""
        return verdict.confirmed(self.confirmation, self.row.config_key)

    def __str__(self) -> str:
        """What won, how fast, what it needs of the budget, whether it was confirmed, how to hand it off."""
        c, row = self.config, self.row
        needed = required_bytes(row.peak_reserved_bytes, row.context_bytes) or 0
        spare = Budget(row.budget_bytes, row.margin_bytes).headroom(needed)
        real = "" if c.lengths is None else "real "  # (batches of the data's lengths: padding left out)
        speed = "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f} {real}tokens/s"
        if row.step_seconds is not None:
            speed += f" ({row.step_seconds:.3f} s per optimizer step)"
        if c.padding_share is not None:
            speed += f", {100 * c.padding_share:.0f}% of its batches padding (your data's lengths)"
        said = self._verdict()
        task = (
            c.task
            if c.target_length is None and c.num_labels is None
            else (
                f"{c.task}, target {c.target_length} tokens"
                if c.target_length is not None
                else f"{c.task}, {c.num_labels} labels"
            )
        )
        context = "" if row.context_bytes is None else f" + context {format_size(row.context_bytes)}"
        lora = ["             model = peft.get_peft_model(model, best.lora_config())"] if c.peft is not None else []
        settings, phases = later_phases.evaluation_lines(c, self.eval_batch, row.phase_peaks)
        args_class = "" if not evaluation.generates(c) else "  # Seq2SeqTrainingArguments: train with Seq2SeqTrainer"
        return "\n".join(
            [
                f"autotune.best({row.study!r}): {row.label}",
                f"  model:     {c.model} ({task}), measured on {self.device_type}",
                f"  levers:    micro_batch={c.micro_batch}, grad_accum={c.grad_accum}, precision={c.precision}, "
                f"checkpointing={c.checkpointing}, block_size={c.block_size}, attention={c.attention}, optimizer={c.optimizer}"
                + (f", weights={c.weights}" if c.weights != "fp32" else "")
                + (f", peft={c.peft}" if c.peft else "")
                + (f", trainer={c.trainer}" if c.trainer != DEFAULT_TRAINER else ""),
                *settings,
                *ranks.summary_lines(c, row.study, self.device_type),
                f"  speed:     {speed}",
                f"  memory:    needs {format_size(needed)} of the {format_size(row.budget_bytes)} budget (peak reserved "
                f"{format_size(row.peak_reserved_bytes)}{context}), "
                + (
                    f"{format_size(spare)} to spare after the {format_size(row.margin_bytes)} margin"
                    if spare >= 0
                    else f"{format_size(-spare)} over once the {format_size(row.margin_bytes)} margin is kept"
                ),
                *phases,
                f"  confirmed: {said}",
                *(f"  note:      {caveat}" for caveat in memory_caveats(c.optimizer)),
                *(f"  note:      {note}" for note in [loss_scaling.loss_fix_note(c.task, c.grad_accum)] if note),
                *(f"  environment: {name}={value}" for name, value in self.environment().items()),
                *self._handoff_lines(lora, args_class),
            ]
        )

    def _handoff_lines(self, lora: list[str], args_class: str) -> list[str]:
        """How to run the pick with the trainer whose step the probes timed."""
        c, study = self.config, self.row.study
        model = f"             model = best.load_model({json.dumps(c.model)})  # or a PretrainedConfig: from_config, random weights"
        if c.trainer == "trl":
            return [
                f'  hand-off:  TRL\'s SFTTrainer (its step was timed): trl.SFTConfig(output_dir="out", **sft_config), '
                f"sft_config from `autotune best --study {study} --format trl`",
                model,
                *lora,
            ]
        collator = (
            [
                f"             Trainer(..., data_collator=best.data_collator(tokenizer))  # "
                f"{'examples end to end, unpadded' if c.padding_free else 'each batch padded to its longest'}"
            ]
            if c.lengths is not None
            else []
        )
        return [
            f'  hand-off:  args = best.training_arguments(output_dir="out"){args_class}',
            model,
            *lora,
            *collator,
            f"             or `autotune train --study {study} --dataset ...`; flags for {EXAMPLE_SCRIPTS[Task(c.task)]}: "
            f"`autotune best --study {study} --format cli`",
        ]

    def __repr__(self) -> str:
        return str(self)

    def _verdict(self) -> str:
        """The study's decision on this winner, in words (autotune.results.verdict: what the search said)."""
        return verdict.answer(self.confirmation, self.row.config_key)

    @property
    def reliable(self) -> bool | None:
        """Whether the study's confirmation round could tell the pick apart from its contenders
        beyond the timing noise; None where no round decided (not known: `--no-confirm`, a search
        stopped early)."""
        return verdict.known_reliable(self.confirmation)

    def to_dict(self) -> dict:
        """Flat and JSON-ready; the keys of `autotune best --format json`. `margin`: the winner's
        throughput over the runner-up's, minus 1; `confirmed`: told apart from the configs within
        noise of it by measuring them again (False: a tie, or no confirmation round ran);
        `reliable`: False when the timing could not tell the contenders apart beyond its noise, None
        where no round decided (not known); `environment`: the variables the run must start with, as
        the probes ran (`environment()`)."""
        c = self.confirmation or {}
        return {
            **self.row.to_dict(),
            "margin": c.get("margin"),
            "margin_noise": c.get("noise"),
            "confirmed": self.confirmed,
            "reliable": self.reliable,
            "environment": self.environment(),
            **({"lora_config": self.lora_kwargs()} if self.config.peft is not None else {}),
        }

    def trainer_kwargs(self) -> dict:
        """Keyword arguments for `transformers.TrainingArguments` (output_dir aside), named as the
        installed transformers names them (activation_checkpointing from 5.23 on). `tf32` is always
        given: transformers turns TF32 on with torch_compile unless it is, through torch's new TF32
        API, which torch.compile 2.10/2.11 refuses beside the legacy flag; only a tf32 winner has it on."""
        c = self.config
        checkpointing, checkpointing_kwargs = checkpointing_argument_names()
        kwargs = {
            "per_device_train_batch_size": c.micro_batch,
            "gradient_accumulation_steps": c.grad_accum,
            "fp16": c.precision == "fp16",
            "bf16": c.precision == "bf16",
            "tf32": c.precision == "tf32",
            checkpointing: c.checkpointing,
            "optim": OPTIMIZERS[c.optimizer].optim,
        }
        if OPTIMIZERS[c.optimizer].optim_args:
            kwargs["optim_args"] = OPTIMIZERS[c.optimizer].optim_args
        if c.checkpointing:
            kwargs[checkpointing_kwargs] = {"use_reentrant": False}
        # Speed levers (autotune.levers.speed_levers); the allocator's is an environment variable (`environment`).
        if c.compile:
            kwargs["torch_compile"] = True
        if c.liger:
            kwargs["use_liger_kernel"] = True
        if self.device_type == "cpu":
            kwargs["use_cpu"] = True
        kwargs.update(sampling_arguments(c.sampling))  # (a recipe lever the user allowed: the order trained on)
        kwargs.update(ranks.trainer_kwargs(c))  # several GPUs: fsdp/fsdp_config, or DDP's setting
        kwargs.update(self.eval_kwargs())
        return kwargs

    def accelerate_config(self) -> dict:
        """The run's processes as accelerate's config file has them (handoff/ranks.py); `accelerate_yaml()`
        is the file. Batch size and accumulation are the script's: `trainer_kwargs()`."""
        return ranks.accelerate_config(self.config, self.device_type)

    def accelerate_yaml(self) -> str:
        """The file for `accelerate launch --config_file` (`autotune best --format accelerate`)."""
        return ranks.accelerate_yaml(self.config, self.device_type, self.row.study)

    def launch_command(
        self, script: str = "train.py", launcher: str = "accelerate", config_file: str = ranks.ACCELERATE_CONFIG_FILE
    ) -> str:
        """The command that starts the run: `accelerate launch --config_file F script` (any script), or
        launcher="torchrun" (`torchrun --nproc-per-node N script`, a Trainer script given `trainer_kwargs()`)."""
        return ranks.launch_command(
            self.config, script, launcher=launcher, config_file=config_file, device_type=self.device_type
        )

    def eval_kwargs(self) -> dict:
        """TrainingArguments' evaluation fields as the probe measured them (later_phases.eval_kwargs)."""
        return later_phases.eval_kwargs(self.config, self.eval_batch)

    def training_arguments_class(self) -> str:
        """`TrainingArguments`, or `Seq2SeqTrainingArguments` where the run generates."""
        return later_phases.arguments_class(self.config)

    def environment(self) -> dict[str, str]:
        """Environment variables the training process must start with, as the probes ran: the CUDA
        allocator's setting (read once when CUDA initialises) and OpenMP's (threads, wait policy:
        read once when torch loads). No flag or argument can set them. (`autotune train` sets both
        itself: fine_tune.adopt_study_openmp.)"""
        return {**self.allocator_environment(), **dict(self.openmp)}

    def allocator_environment(self) -> dict[str, str]:
        """The CUDA allocator's setting of the winner, as environment variables (none for the default)."""
        value = speed_levers.alloc_conf(self.config.allocator)
        return {} if value is None else {name: value for name in speed_levers.ALLOC_CONF_VARS}

    def openmp_caveat(self, what: str) -> str | None:
        """One line: start `what` under the OpenMP settings the probes ran under (None: none known)."""
        if not self.openmp:
            return None
        return (
            f"the probes ran with {openmp_text(self.openmp)}: start {what} with them in its environment (OpenMP reads them once, "
            f"when torch loads; other threads or a spinning wait policy time the same step differently)"
        )

    def model_kwargs(self) -> dict:
        """Keyword arguments for `from_pretrained` of the task's Auto class: `load_kwargs()` and
        `config_overrides()` together, as from_pretrained takes them (it sets the config fields). Not
        for `from_config`, which takes no config field: there, `load_kwargs()` after the overrides."""
        load, overrides = self.load_kwargs(), self.config_overrides()
        kwargs: dict = {
            "attn_implementation": load["attn_implementation"],
            "use_cache": overrides["use_cache"],
            "dtype": load["dtype"],
        }
        if "num_labels" in overrides:
            kwargs["num_labels"] = overrides["num_labels"]
        if "quantization_config" in load:
            kwargs["quantization_config"] = load["quantization_config"]
        return kwargs

    def load_kwargs(self) -> dict:
        """Loading arguments of the task's Auto class (from_pretrained and from_config): the attention
        kernel, and the dtype always: transformers 5 loads a checkpoint in its saved dtype by default
        ("auto"), and a bf16 checkpoint trained so is pure bf16, not the fp32 master weights the probes
        measured. QLoRA's base: `quantization_config`, BitsAndBytesConfig's arguments (from_pretrained
        takes them as a dict; `quantization_config()` is the object)."""
        kwargs: dict = {
            "attn_implementation": self.config.attention,
            "dtype": "bfloat16" if self.config.weights == "bf16" else "float32",
        }
        if is_qlora(self.config.peft):
            kwargs["quantization_config"] = bnb_4bit_kwargs(self.config.precision, self.config.task)
        return kwargs

    def config_overrides(self) -> dict:
        """The model config's fields as the probes trained it: no KV cache (it is for generation), and
        a classifier's head size. `config.update(best.config_overrides())` before `from_config`."""
        overrides: dict = {"use_cache": False}
        if self.config.num_labels is not None:
            overrides["num_labels"] = self.config.num_labels
        return overrides

    def load_model(self, model, **extra):
        """The study's task model (its Auto class, `task_document()["auto_class"]`) built as the probes
        built it: `from_pretrained` for a hub id or a local directory (its weights), `from_config` for a
        `PretrainedConfig` (random weights; the given config is not changed). The config gets
        `config_overrides()`, a classifier a pad token where it has none, a seq2seq model its decoder's
        start token where it has none (autotune.probe.step.task_config, what the probes and `autotune
        train` use), and Trainer's loss scaling right under accumulation (handoff/loss_scaling.py:
        `accepts_loss_kwargs = False` where the model averages each micro-batch itself). `extra` goes to the Auto class (revision, token, trust_remote_code and the like to
        the config's loading too). No LoRA adapters: `peft.get_peft_model(model, best.lora_config())`
        follows for a LoRA or QLoRA winner."""
        import transformers

        from autotune.probe.step import task_config

        cls = getattr(transformers, AUTO_CLASSES[Task(self.config.task)])
        load = self.load_kwargs()
        if isinstance(model, transformers.PretrainedConfig):
            if "quantization_config" in load:
                raise BadInput(
                    "a QLoRA base is a pretrained checkpoint quantized to 4 bits as it loads: pass its hub id or "
                    "directory to load_model, not a config."
                )
            config = task_config(copy.deepcopy(model), self.config)
            built = cls.from_config(config, **{**load, **extra})
            later_phases.generate_with_cache(built, self.config)
            loss_scaling.fix_loss_scaling(built)
            return built
        hub = {name: extra[name] for name in _HUB_ARGUMENTS if name in extra}
        if _holds_no_weights(model):
            # A directory of config.json alone (what a search probes): random weights, as the probes had.
            warnings.warn(
                f"autotune: {model} holds a config.json but no weights: the model is built from its config "
                f"with random weights, as the search probed it",
                stacklevel=2,
            )
            return self.load_model(
                transformers.AutoConfig.from_pretrained(model, **hub),
                **{
                    name: value
                    for name, value in extra.items()
                    if name not in _HUB_ARGUMENTS or name == "trust_remote_code"
                },
            )
        config = task_config(transformers.AutoConfig.from_pretrained(model, **hub), self.config)
        if self.config.task == Task.CLASSIFICATION:
            # A checkpoint's classifier of another size is replaced by a new one, as `autotune train`
            # and run_classification.py's --ignore_mismatched_sizes do.
            extra.setdefault("ignore_mismatched_sizes", True)
        built = cls.from_pretrained(model, config=config, **{**load, **extra})
        later_phases.generate_with_cache(built, self.config)
        loss_scaling.fix_loss_scaling(built)
        return built

    def quantization_config(self):
        """A ready `transformers.BitsAndBytesConfig` for a QLoRA winner's 4-bit base (None otherwise)."""
        if not is_qlora(self.config.peft):
            return None
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**bnb_4bit_kwargs(self.config.precision, self.config.task))

    def lora_kwargs(self) -> dict | None:
        """`peft.LoraConfig`'s arguments for a LoRA/QLoRA winner (None for full fine-tuning)."""
        if self.config.peft is None:
            return None
        spec = PeftSpec.from_text(self.config.peft)
        return {"task_type": PEFT_TASK_TYPES.get(self.config.task), **spec.lora_kwargs()}

    def lora_config(self):
        """A ready `peft.LoraConfig` for a LoRA winner (None for full fine-tuning): pass it to
        `peft.get_peft_model(model, ...)`."""
        kwargs = self.lora_kwargs()
        if kwargs is None:
            return None
        from peft import LoraConfig

        return LoraConfig(**kwargs)

    def task_document(self) -> dict:
        """What is trained: the task, the Auto class that builds it, the example script it hands
        off to, and the lengths the probes measured."""
        c = self.config
        task = Task(c.task)
        document: dict = {"task": c.task, "auto_class": AUTO_CLASSES[task], "example_script": EXAMPLE_SCRIPTS[task]}
        if task == Task.SEQ2SEQ:
            document.update(max_source_length=c.block_size, max_target_length=c.target_length)
        elif task == Task.CLASSIFICATION:
            document.update(max_seq_length=c.block_size, num_labels=c.num_labels)
        elif task == Task.MASKED_LM:
            document.update(max_seq_length=c.block_size, mlm_probability=MLM_PROBABILITY)
        else:
            document.update(block_size=c.block_size)
        return document

    def training_arguments(self, output_dir: str, **overrides):
        """A `transformers.TrainingArguments` with the winning levers (overrides win): a
        `Seq2SeqTrainingArguments` where the run generates (`training_arguments_class()`), or where the
        overrides name one of its own fields."""
        import dataclasses

        import transformers

        kwargs = {**self.trainer_kwargs(), **overrides}
        cls = getattr(transformers, self.training_arguments_class())
        seq2seq = transformers.Seq2SeqTrainingArguments
        if {f.name for f in dataclasses.fields(seq2seq)}.difference(f.name for f in dataclasses.fields(cls)) & set(
            kwargs
        ):
            cls = seq2seq
        names = {f.name for f in dataclasses.fields(cls)}
        # transformers 5.23 renamed gradient_* to activation_* (the old names warn until v6):
        # trainer_kwargs names them from the installed version; overrides may use either name.
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if old in kwargs and new in names and new not in kwargs:
                kwargs[new] = kwargs.pop(old)
        return cls(output_dir=output_dir, **kwargs)

    def data_collator(self, tokenizer):
        """The collator that makes the batches the probes timed (autotune.data.task_data.task_collator):
        a per-example study's padded to each batch's longest, or end to end (padding-free)."""
        from autotune.data.task_data import task_collator

        c = self.config
        return task_collator(c.task, tokenizer, c.lengths is not None, c.padding_free)

    def trainer_args_document(self) -> dict:
        document = {
            "training_arguments": self.trainer_kwargs(),
            "model_kwargs": self.model_kwargs(),
            "block_size": self.config.block_size,
            **self.task_document(),
        }
        if self.config.peft is not None:
            document["lora_config"] = self.lora_kwargs()
        if self.environment():
            document["environment"] = self.environment()
        if (note := loss_scaling.loss_fix_note(self.config.task, self.config.grad_accum)) is not None:
            # No TrainingArguments field carries it: an attribute of the model (load_model sets it).
            document["model_attributes"] = {loss_scaling.ATTRIBUTE: False}
            document["notes"] = [note]
        if self.config.ranks > 1:  # per_device_train_batch_size x accumulation x processes
            document.update(
                effective_batch=self.config.effective_batch,
                launch={launcher: self.launch_command(launcher=launcher) for launcher in ("accelerate", "torchrun")},
            )
        if evaluation.generates(self.config):
            # predict_with_generate is none of TrainingArguments', and only Seq2SeqTrainer generates.
            document.update(training_arguments_class=self.training_arguments_class(), trainer_class="Seq2SeqTrainer")
        return document

    def cli_flags(self) -> str:
        """The matching flags of the task's Hugging Face example script (handoff/scripts.py)."""
        return scripts.cli_flags(self)

    def cli_caveats(self) -> list[str]:
        """What the example script's flags cannot say about the winner (for stderr, beside `cli`)."""
        return scripts.cli_caveats(self)

    def yaml(self) -> str:
        """YAML without a YAML dependency: the document is flat scalars and one nested level."""
        scalar = yaml_text.scalar
        lines = []
        for key, value in self.to_dict().items():
            # A mapping or a list (phase_peaks, lora_config) in JSON's flow style, which YAML reads.
            lines.append(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else scalar(value)}")
        if evaluation.generates(self.config):
            lines.append(f"training_arguments_class: {scalar(self.training_arguments_class())}")
        lines.append("trainer_args:")
        for key, value in self.trainer_kwargs().items():
            lines.append(f"  {key}: {json.dumps(value) if isinstance(value, dict) else scalar(value)}")
        lines.append("task:")
        for key, value in self.task_document().items():
            lines.append(f"  {key}: {scalar(value)}")
        lines.append("model_kwargs:")
        for key, value in self.model_kwargs().items():
            lines.append(f"  {key}: {json.dumps(value) if isinstance(value, dict) else scalar(value)}")
        return "\n".join(lines)

    def notes(self, fmt: str) -> list[str]:
        """What `autotune best` says beside the document (on stderr): what the format cannot say,
        a pick the confirmation round could not tell apart, a format that runs another trainer than the
        probes timed, the optimizer's memory caveats."""
        from autotune.levers.recipes import FORMAT_TRAINERS, memory_caveats, trainer_caveat
        from autotune.results.verdict import unreliable_warning

        said = [f"note: {caveat}" for caveat in (self.cli_caveats() if fmt == "cli" else [])]
        if (warning := unreliable_warning(self.confirmation)) is not None:
            said.append(f"warning: {warning}")
        runs = FORMAT_TRAINERS.get(fmt)
        if runs is not None and (caveat := trainer_caveat(self.config.trainer, runs, f"--format {fmt}")) is not None:
            said.append(f"warning: {caveat}")
        return said + [f"note: {caveat}" for caveat in memory_caveats(self.config.optimizer)]

    def render(self, fmt: str) -> str:
        if fmt == "json":
            return json.dumps(self.to_dict(), indent=2)
        if fmt == "yaml":
            return self.yaml()
        if fmt == "trainer-args":
            return json.dumps(self.trainer_args_document(), indent=2)
        if fmt == "cli":
            return self.cli_flags()
        if fmt == "accelerate":
            return self.accelerate_yaml()
        if fmt in tools.TOOL_FORMATS:
            return tools.render_tool(self, fmt)
        raise ValueError(f"unknown format {fmt!r}")


def _holds_no_weights(model) -> bool:
    """A local directory with a config.json and none of the weight files from_pretrained reads."""

    from autotune.specs.models import WEIGHT_FILES

    directory = Path(str(model)).expanduser()
    return (directory / "config.json").is_file() and not any((directory / name).is_file() for name in WEIGHT_FILES)


def _nothing_fits(study: StudyRecord, probes: list[ProbeRecord]) -> str:
    """Why a study has no winner yet, and what to do: it stopped before its first probe, it stopped
    before any config that fits, or it searched through and nothing fits its budget."""
    measured = [p for p in probes if p.result.status != ProbeStatus.SKIPPED]
    if study.status != StudyStatus.FINISHED:
        so_far = f"none of its {len(measured)} probes so far fits" if measured else "it has no probe yet"
        return (
            f"study {study.name!r} is {study.status} and {so_far}; run the same `autotune search` command to go on "
            f"from where it stopped."
        )
    return (
        f"study {study.name!r} searched every candidate and none fits its {format_size(study.budget_bytes)} budget; "
        f"search again with a larger --gpu-budget, or with --checkpointing on, smaller --micro-batches or "
        f"--block-sizes, or --precisions bf16."
    )


def best(study: str | None = None, db: str | None = None) -> BestConfig:
    """The fastest configuration that fits in `study` (the most recent study when None). Reads
    only: a missing or outdated database is refused, never created or upgraded."""
    with open_store(db, read_only=True) as store:
        return best_in(store, study)


def best_in(store, study: str | None = None) -> BestConfig:
    """`best` from an open store (the service keeps one open)."""
    rows = store.leaderboard(study, top=1)
    if not rows:
        raise StudyNotFound(_nothing_fits(store.study(study), store.probes(study)))
    record = store.study(rows[0].study)
    device_type = record.environment.get("device_type") or "cuda"
    return BestConfig(
        rows[0],
        device_type,
        record.confirmation,
        openmp_of(record.environment.get("openmp")),
        record.device_name,
    )
