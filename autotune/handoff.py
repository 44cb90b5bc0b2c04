"""The hand-off: a study's winning configuration in the forms a fine-tune consumes.

    import autotune
    best = autotune.best("gpt2-8GiB")
    args = best.training_arguments(output_dir="out")       # a real transformers.TrainingArguments
    model = AutoModelForCausalLM.from_pretrained("gpt2", **best.model_kwargs())  # dtype; a QLoRA base's quantization
    model = peft.get_peft_model(model, best.lora_config())  # LoRA and QLoRA winners
    # the Auto class and example script of the study's task: best.task_document()
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from autotune import speed
from autotune.errors import StudyNotFound
from autotune.recipes import OPTIMIZERS, PEFT_TASK_TYPES, PeftSpec, bnb_4bit_kwargs, is_qlora
from autotune.store import LeaderboardRow, open_store
from autotune.tasks import AUTO_CLASSES, EXAMPLE_SCRIPTS, MLM_PROBABILITY, Task


# Words that an unquoted `$(...)` in bash or zsh passes on unchanged: no space to split at, no
# glob character, no quote or `$` the shell would keep literally where the user expected it read.
_SPLITS_AS_ONE_WORD = re.compile(r'[A-Za-z0-9_.,:=/+{}"-]+')


@dataclass(frozen=True, slots=True)
class BestConfig:
    row: LeaderboardRow
    device_type: str = "cuda"   # where the study measured: a CPU study hands off to a CPU run
    confirmation: dict | None = None  # the study's confirmation round (search/confirm.py), if one ran

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
    def task(self) -> str:
        return self.config.task

    def to_dict(self) -> dict:
        """Flat and JSON-ready; the keys of `autotune best --format json`. `margin`: the winner's
        throughput over the runner-up's, minus 1; `confirmed`: told apart from the configs within
        noise of it by measuring them again (False: a tie, or no confirmation round ran)."""
        c = self.confirmation or {}
        return {**self.row.to_dict(), "margin": c.get("margin"), "margin_noise": c.get("noise"),
                "confirmed": bool(c.get("confirmed")) and c.get("winner") == self.row.config_key,
                **({"lora_config": self.lora_kwargs()} if self.config.peft is not None else {})}

    def trainer_kwargs(self) -> dict:
        """Keyword arguments for `transformers.TrainingArguments` (output_dir aside)."""
        c = self.config
        kwargs = {
            "per_device_train_batch_size": c.micro_batch,
            "gradient_accumulation_steps": c.grad_accum,
            "fp16": c.precision == "fp16",
            "bf16": c.precision == "bf16",
            "gradient_checkpointing": c.checkpointing,
            "optim": OPTIMIZERS[c.optimizer].optim,
        }
        if OPTIMIZERS[c.optimizer].optim_args:
            kwargs["optim_args"] = OPTIMIZERS[c.optimizer].optim_args
        if c.checkpointing:
            kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        # Speed levers (autotune.speed); the allocator's is an environment variable (`environment`).
        if c.precision == "tf32":
            kwargs["tf32"] = True
        if c.compile:
            kwargs["torch_compile"] = True
        if c.liger:
            kwargs["use_liger_kernel"] = True
        if self.device_type == "cpu":
            kwargs["use_cpu"] = True
        return kwargs

    def environment(self) -> dict[str, str]:
        """Environment variables the training process must start with: the CUDA allocator's
        setting, read once when CUDA initialises (`autotune train` sets it itself)."""
        value = speed.alloc_conf(self.config.allocator)
        return {} if value is None else {speed.ALLOC_CONF_VAR: value}

    def model_kwargs(self) -> dict:
        """Keyword arguments for `from_pretrained` of the task's Auto class (config fields ride along). The
        dtype always: transformers 5 loads a checkpoint in its saved dtype by default ("auto"), and
        a bf16 checkpoint trained so is pure bf16, not the fp32 master weights the probes measured.
        QLoRA's base: `quantization_config`, BitsAndBytesConfig's arguments (from_pretrained takes
        them as a dict; `quantization_config()` is the object)."""
        kwargs: dict = {"attn_implementation": self.config.attention, "use_cache": False,
                        "dtype": "bfloat16" if self.config.weights == "bf16" else "float32"}
        if self.config.num_labels is not None:
            kwargs["num_labels"] = self.config.num_labels
        if is_qlora(self.config.peft):
            kwargs["quantization_config"] = bnb_4bit_kwargs(self.config.precision, self.config.task)
        return kwargs

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
        """A `transformers.TrainingArguments` with the winning levers (overrides win)."""
        import dataclasses

        from transformers import TrainingArguments

        kwargs = {**self.trainer_kwargs(), **overrides}
        names = {f.name for f in dataclasses.fields(TrainingArguments)}
        # transformers 5.2x renamed gradient_* to activation_* (the old names warn until v6); the
        # printed hand-off keeps the names every transformers 5 accepts, this one uses the newest.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if old in kwargs and new in names and new not in kwargs:
                kwargs[new] = kwargs.pop(old)
        return TrainingArguments(output_dir=output_dir, **kwargs)

    def trainer_args_document(self) -> dict:
        document = {"training_arguments": self.trainer_kwargs(), "model_kwargs": self.model_kwargs(),
                    "block_size": self.config.block_size, **self.task_document()}
        if self.config.peft is not None:
            document["lora_config"] = self.lora_kwargs()
        if self.environment():
            document["environment"] = self.environment()
        return document

    def cli_flags(self) -> str:
        """The matching flags of the task's Hugging Face example script (transformers/examples/pytorch):
        run_clm.py, run_summarization.py, run_classification.py (run_glue.py takes the same
        length flag) or run_mlm.py. The lengths are the ones the probes measured; the seq2seq and
        classification scripts pad to them with --pad_to_max_length, as the probes' batches are full."""
        c = self.config
        task = Task(c.task)
        flags = ["--per_device_train_batch_size", str(c.micro_batch), "--gradient_accumulation_steps", str(c.grad_accum)]
        if task == Task.SEQ2SEQ:
            flags += ["--max_source_length", str(c.block_size), "--max_target_length", str(c.target_length),
                      "--pad_to_max_length"]
        elif task == Task.CLASSIFICATION:
            flags += ["--max_seq_length", str(c.block_size), "--pad_to_max_length"]
        elif task == Task.MASKED_LM:
            flags += ["--max_seq_length", str(c.block_size)]
        else:
            flags += ["--block_size", str(c.block_size)]
        flags += ["--optim", OPTIMIZERS[c.optimizer].optim]
        if OPTIMIZERS[c.optimizer].optim_args:
            flags += ["--optim_args", str(OPTIMIZERS[c.optimizer].optim_args)]
        if c.precision in ("fp16", "bf16"):
            flags.append(f"--{c.precision}")
        elif c.precision == "tf32":
            flags += ["--tf32", "true"]  # TrainingArguments' tf32 takes a value (a bare --tf32 is refused)
        if c.weights == "bf16" and task == Task.CAUSAL_LM:
            # Pure bf16: run_clm.py loads the model in the dtype it is given (--torch_dtype before
            # transformers 4.56, rejected by the scripts of transformers 5); the others have no flag.
            flags += ["--dtype", "bfloat16"]
        if c.checkpointing:
            # Compact JSON: one word with no space, so that `$(autotune best --format cli)` splits
            # it as the script expects (quotes inside a substitution are not the shell's).
            flags += ["--gradient_checkpointing", "--gradient_checkpointing_kwargs",
                      json.dumps({"use_reentrant": False}, separators=(",", ":"))]
        if c.compile:
            flags.append("--torch_compile")
        if c.liger:
            flags.append("--use_liger_kernel")
        if self.device_type == "cpu":
            flags.append("--use_cpu")  # the study measured a CPU run
        assert all(_SPLITS_AS_ONE_WORD.fullmatch(flag) for flag in flags), flags
        return " ".join(flags)

    def cli_caveats(self) -> list[str]:
        """What the example script's flags cannot say about the winner (for stderr, beside `cli`)."""
        c = self.config
        script = EXAMPLE_SCRIPTS[Task(c.task)]
        caveats = []
        if c.attention != "sdpa":
            caveats.append(f"attention {c.attention}: {script} has no flag for it (it loads sdpa); load the model with "
                           f"attn_implementation={c.attention!r}, or train with `autotune train --study {self.row.study}`")
        if c.weights == "bf16" and Task(c.task) != Task.CAUSAL_LM:  # run_clm.py takes --dtype (cli_flags)
            caveats.append(f"pure bf16 weights: {script} has no flag to load the model in bf16; load it with "
                           f"dtype=torch.bfloat16, or train with `autotune train --study {self.row.study}`")
        if c.peft is not None:
            caveats.append(f"{PeftSpec.from_text(c.peft).text()}: {script} has no PEFT flags; wrap the model with "
                           f"`autotune.best(...).lora_config()`, or train with `autotune train --study {self.row.study}`")
        if is_qlora(c.peft):
            caveats.append(f"4-bit base: {script} cannot quantize; load the model with quantization_config="
                           f"`autotune.best(...).quantization_config()`, or train with `autotune train --study {self.row.study}`")
        for name, value in self.environment().items():  # read once, when CUDA starts: no flag can set it
            caveats.append(f"allocator {c.allocator}: start {script} with {name}={value} in its environment "
                           f"(`{name}={value} python {script} ...`)")
        return caveats

    def yaml(self) -> str:
        """YAML without a YAML dependency: the document is flat scalars and one nested level."""
        def scalar(value) -> str:
            if isinstance(value, bool):
                return "true" if value else "false"
            if value is None:
                return "null"
            if isinstance(value, (int, float)):
                return repr(value)
            return json.dumps(str(value))

        lines = []
        for key, value in self.to_dict().items():
            lines.append(f"{key}: {scalar(value)}")
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

    def render(self, fmt: str) -> str:
        if fmt == "json":
            return json.dumps(self.to_dict(), indent=2)
        if fmt == "yaml":
            return self.yaml()
        if fmt == "trainer-args":
            return json.dumps(self.trainer_args_document(), indent=2)
        if fmt == "cli":
            return self.cli_flags()
        raise ValueError(f"unknown format {fmt!r}")


def best(study: str | None = None, db: str | None = None) -> BestConfig:
    """The fastest configuration that fits in `study` (the most recent study when None). Reads
    only: a missing or outdated database is refused, never created or upgraded."""
    with open_store(db, read_only=True) as store:
        rows = store.leaderboard(study, top=1)
        if not rows:
            name = study or store.latest_study_name()
            raise StudyNotFound(f"study {name!r} has no configuration that fits yet; run `autotune search` "
                                f"(with a larger --gpu-budget if everything ran out of memory).")
        record = store.study(rows[0].study)
        device_type = record.environment.get("device_type") or "cuda"
    return BestConfig(rows[0], device_type, record.confirmation)
