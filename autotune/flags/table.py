"""Every flag of the commands a request can name (`search`, `plan`, `estimate`, and `probe`, which
shares estimate's levers), one row each, in the order --help lists them. The command line decorates
its commands with these tables; the service reads a request's body with them (flag.py). Add a flag
here and to the library that uses it (search/request.py routes a search's by its `Part`): both
doors have it.

The groups are shared: what is trained (TASK), where the data is (DATA), the levers searched
(SPACE_LEVERS), one configuration's levers (CONFIG), how probes run (PROBE_SETTINGS)."""

from __future__ import annotations

from autotune.vocabulary import defaults
from autotune.flags.flag import Flag, Part
from autotune.flags.values import (
    COUNT,
    DEVICE,
    DURATION,
    PASSES,
    REAL,
    RENDEZVOUS,
    SECONDS,
    SECONDS_OR_ZERO,
    STEPS,
)
from autotune.launchers import LAUNCHERS

import click

DEVICE_HELP = "auto (CUDA if present, else CPU), cpu, cuda or cuda:N."
OPTIMIZER_HELP = (
    "adamw (fused AdamW; also adamw_torch_fused), adamw_torch (torch's default: foreach on CUDA, full-size "
    "temporaries in the step), adafactor, sgd (momentum 0.9), adamw_8bit (also adamw_bnb_8bit) or "
    "paged_adamw_8bit (bitsandbytes): TrainingArguments' optim names."
)
STACK_HELP = (
    "Predict a run on older library versions than the installed ones, where they allocated differently: "
    "torch=1.13,bitsandbytes=0.41.1 (torch before 1.11 kept softmax's input, before 2.0 the zeroed "
    "gradients; bitsandbytes before 0.43.2 each 4-bit layer's input) [default: the installed ones]."
)
WEIGHTS_HELP = (
    "fp32 (master weights; mixed precision autocasts) or bf16 (pure bf16: weights, gradients, optimizer state)."
)
ALLOCATOR_HELP = (
    "The CUDA caching allocator's setting: default, or expandable (expandable_segments:True in "
    "PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF: less fragmentation, so reserved stays near allocated)."
)
TRAINER_HELP = (
    "The trainer your run uses, whose step the probes time (a recipe lever): transformers (Trainer, "
    "autotune train, axolotl, LLaMA-Factory) or trl (TRL's SFTTrainer: its fused LM head scores "
    "entropy and accuracy every micro-step; causal LMs; needs trl). A --from TRL file sets trl."
)
PACKING_HELP = (
    "Causal LMs: on, examples packed into full blocks (run_clm.py, TRL packing: true, axolotl "
    "sample_packing: true); off, each example a row padded to its batch's longest (TRL's default, "
    "axolotl's and LLaMA-Factory's): a recipe lever. With --dataset, off times batches drawn from "
    "your examples' lengths and ranks by real (non-padding) tokens/s."
)
SAMPLING_HELP = (
    "How your run's sampler orders the examples, a recipe lever: random, or group_by_length "
    "(transformers' LengthGroupedSampler: each micro-batch of about one length, less padding, another "
    "order trained on); random,group_by_length lets the search choose. Needs --dataset's lengths."
)
PADDING_FREE_HELP = (
    "Causal LMs trained per example (--packing off with --dataset): each micro-batch's examples "
    "end to end in one row, no padding, each attending only to itself (TRL padding_free, "
    "transformers' DataCollatorWithFlattening): off, on, or off,on to let the search choose. "
    "The same math where the attention kernel keeps examples apart (checked in each probe)."
)
LIGER_HELP = "Liger's Triton kernels (fused linear + cross-entropy, RMSNorm, RoPE, SwiGLU): CUDA and liger-kernel only."
DB_HELP = (
    "SQLAlchemy URL of the results database [default: $AUTOTUNE_DB, else a SQLite file in the user data directory]."
)
GPUS_HELP = (
    "Ranks on each node (one GPU each, or one CPU process each on --device cpu) that share the run, "
    "started by torchrun; each holds --micro-batch sequences per micro-step, the budget is each card's."
)
NODES_HELP = (
    "Machines of --gpus ranks each (torchrun's rendezvous at --rendezvous; the others run `autotune node`): "
    "the run has gpus x nodes ranks."
)
STRATEGY_HELP = (
    "How --gpus 2 or more share the run: ddp (a whole copy per rank), fsdp (FSDP2, everything sharded), "
    "fsdp-grad-op (parameters kept gathered from forward to backward), fsdp-offload (sharded state on "
    "the host) [default: ddp]."
)
MODEL_HELP = "Hub id, gpt2-family name, or a local directory with config.json."
MARGIN_HELP = "Room kept free under the budget: a percentage of it or a size (256MiB)."
REMOTE_CODE_HELP = "Allow a model's own code from its repository to run."
BUDGET_HELP = "Memory to fit in: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes."


def _task_help() -> str:
    from autotune.levers.tasks import TASK_HELP

    return f"What is trained: {TASK_HELP}."


def _stack_text(text: str | None) -> str | None:
    """--stack as given, each library named once (Stack.parse reads the versions): a second
    `torch=` would silently replace the first, and an empty value would mean the installed ones."""
    if text is None:
        return None
    names = [part.partition("=")[0].strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise click.UsageError("--stack is empty; give library=version pairs such as torch=1.13, or leave it out")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise click.UsageError(
            f"--stack names {', '.join(twice)} more than once ({text.strip()[:80]}); give each library one version"
        )
    return text


# -- What is trained (recipe levers, never searched): probe, estimate, search, plan and train --------
TASK = (
    Flag("task", _task_help()),
    Flag(
        "target_length",
        "seq2seq: target tokens per example, from your data [default: 128, as run_summarization.py].",
        type=COUNT,
    ),
    Flag("num_labels", "classification: labels of the head [default: the config's id2label, or 2].", type=COUNT),
    Flag(
        "peft",
        "lora: LoRA adapters on a frozen base (needs peft); qlora: a 4-bit base "
        "too (CUDA and bitsandbytes) [default: full fine-tuning].",
    ),
    Flag("lora_rank", "LoRA rank r [default: 8].", type=COUNT),
    Flag("lora_alpha", "LoRA alpha [default: 16].", type=COUNT),
    Flag("lora_dropout", "LoRA dropout [default: 0.05].", type=REAL),
    Flag(
        "lora_targets",
        "Modules that get adapters: all-linear, or names such as q_proj,v_proj [default: all-linear].",
    ),
    # How the run evaluates (autotune.levers.evaluation): its probes run these phases too.
    Flag(
        "eval_batch",
        "Evaluate with this per_device_eval_batch_size, or auto: the largest up to 64 that fits beside "
        "the training state (each probe finds it). Each probe runs eval batches after its training "
        "steps, and fits only if they fit too [default: no evaluation].",
    ),
    Flag(
        "eval_logits",
        "What evaluation keeps: loss-only (no compute_metrics), or kept logits (compute_metrics), "
        "held on the card for --eval-accumulation-steps batches [default: loss-only].",
        type=click.Choice(["loss-only", "kept"], case_sensitive=False),
    ),
    Flag(
        "eval_accumulation_steps",
        "Eval batches whose kept logits stay on the card before moving to the host (handed off as "
        "eval_accumulation_steps) [default: 1 with --eval-logits kept].",
        type=COUNT,
    ),
    Flag(
        "generate",
        "seq2seq: evaluation generates (predict_with_generate): each probe runs generate too.",
        switch=True,
        default=False,
    ),
    Flag(
        "generation_max_length",
        "--generate: tokens generated, the whole length [default: the target length].",
        type=COUNT,
    ),
    Flag("num_beams", "--generate: beams of the beam search [default: 1].", type=COUNT),
)


def data_flags(*, required: bool) -> tuple[Flag, ...]:
    """Where the data is and which columns hold what: train's data (`required`), and search's and
    plan's, whose longest example is the longest batch to probe (autotune.data.shape)."""
    what = (
        "A local .txt, .json/.jsonl, .csv/.tsv or .parquet file (or directory), or a hub data set "
        "NAME[:CONFIG[:SPLIT]]."
    )
    if not required:
        what += (
            " Seq2seq and classification: its longest example caps the block sizes and the target length "
            "(no batch of it is longer), and gives a classifier its labels."
        )
    return (
        Flag("dataset", what, required=required, default=None, reads=True),
        Flag(
            "text_column",
            "Column holding the text (seq2seq: the source) [default: 'text', or the only text column; "
            "seq2seq also 'document', 'article', 'source', 'dialogue', 'input'; classification also "
            "'sentence'].",
        ),
        Flag(
            "target_column",
            "seq2seq: column holding the target text [default: 'summary', 'target', 'highlights' or 'output'].",
        ),
        Flag(
            "label_column",
            "classification: column holding the labels, text or whole-number ids [default: 'label'].",
        ),
        Flag("tokenizer", "Tokenizer directory or hub id [default: the model's own].", reads=True),
    )


# -- The search space: search and plan (the recipe levers come with it) ----------------------------
SPACE_LEVERS = (
    Flag(
        "effective_batch",
        "Sequences per optimizer step, kept fixed; accumulation = effective batch / micro-batch "
        f"[default: {defaults.EFFECTIVE_BATCH}].",
        type=COUNT,
    ),
    Flag(
        "effective_tokens",
        f"Tokens per optimizer step, for several --block-sizes [default: {defaults.EFFECTIVE_BATCH} x the largest block].",
        type=COUNT,
    ),
    Flag(
        "micro_batches",
        f"Micro-batches to try [default: {','.join(map(str, defaults.MICRO_BATCHES))} up to the effective batch].",
    ),
    Flag("block_sizes", f"Block sizes to try [default: {defaults.BLOCK_SIZE}, or the model's maximum if smaller]."),
    Flag("precisions", "Precisions to try.", default=",".join(defaults.PRECISIONS), show_default=True),
    Flag(
        "checkpointing",
        "Gradient checkpointing: on, off or both.",
        default=",".join("on" if c else "off" for c in defaults.CHECKPOINTING),
        show_default=True,
        param="checkpointing_",
    ),
    Flag("attention", "Attention implementations to try.", default=",".join(defaults.ATTENTIONS), show_default=True),
    Flag(
        "optimizers",
        "Optimizers the search may choose among (a recipe lever: list only those you accept): " + OPTIMIZER_HELP,
        default=defaults.OPTIMIZER,
        show_default=True,
    ),
    Flag(
        "weights",
        "Weights dtypes the search may choose among (fp32, bf16: a recipe lever).",
        default="fp32",
        show_default=True,
        param="weights_",
    ),
    Flag(
        "compile",
        "torch.compile: off, on, or off,on to let the search choose (compile time is reported apart).",
        default="off",
        show_default=True,
        param="compile_",
    ),
    Flag(
        "allocators",
        "CUDA allocator settings to try: default, expandable (expandable_segments:True), or both.",
        default="default",
        show_default=True,
    ),
    Flag("liger", "Liger's kernels (CUDA, liger-kernel): off, on or off,on.", default="off", show_default=True),
    Flag("trainer", TRAINER_HELP + " [default: transformers, or the --from file's tool]"),
    Flag("packing", PACKING_HELP + " [default: on, or the --from file's]"),
    Flag("sampling", SAMPLING_HELP + " [default: random, or the --from file's]"),
    Flag("padding_free", PADDING_FREE_HELP + " [default: off, or the --from file's]"),
    Flag("gpus", GPUS_HELP, type=COUNT, default=1, show_default=True),
    Flag("nodes", NODES_HELP, type=COUNT, default=1, show_default=True),
    Flag(
        "strategies",
        "With --gpus 2 or more: how the ranks may share the run, among ddp, fsdp, fsdp-grad-op and "
        "fsdp-offload (they keep the math: searched) [default: all four].",
    ),
)
SPACE = (*data_flags(required=False), *TASK, *SPACE_LEVERS)

# -- One configuration's levers: probe and estimate ------------------------------------------------
CONFIG = (
    *TASK,
    Flag("model", MODEL_HELP, part=Part.WHAT, required=True, reads=True),
    Flag("micro_batch", "Sequences per forward/backward pass.", type=COUNT, required=True),
    Flag("block_size", "Tokens per sequence.", type=COUNT, required=True),
    Flag("grad_accum", "Micro-steps per optimizer step.", type=COUNT, default=1, show_default=True),
    Flag(
        "precision",
        "fp32, fp16 (with a gradient scaler), bf16 (mixed precision) or tf32 (fp32 with TF32 matmuls, CUDA).",
        default=defaults.PRECISION,
        show_default=True,
    ),
    Flag("checkpointing", "Gradient (activation) checkpointing.", negatable=True, default=False, show_default=True),
    Flag(
        "attention",
        "Attention implementation: sdpa, eager, flash_attention_2, ...",
        default=defaults.ATTENTION,
        show_default=True,
    ),
    Flag("optimizer", OPTIMIZER_HELP, default=defaults.OPTIMIZER, show_default=True),
    Flag("weights", WEIGHTS_HELP, default="fp32", show_default=True),
    Flag(
        "compile",
        "torch.compile the model (inductor); its compile time is reported apart from the timing.",
        negatable=True,
        default=False,
        show_default=True,
        param="compile_",
    ),
    Flag("allocator", ALLOCATOR_HELP, default="default", show_default=True),
    Flag("liger", LIGER_HELP, negatable=True, default=False, show_default=True),
    Flag("trainer", TRAINER_HELP + " [default: transformers]"),
    Flag("gpus", GPUS_HELP, type=COUNT, default=1, show_default=True),
    Flag("strategy", STRATEGY_HELP),
    Flag("nodes", NODES_HELP, type=COUNT, default=1, show_default=True),
)

# -- How probes run: probe and search ---------------------------------------------------------------
PROBE_SETTINGS = tuple(
    Flag(**row, part=Part.PROBE)  # type: ignore[arg-type]
    for row in (
        dict(name="device", help=DEVICE_HELP, type=DEVICE, default="auto", show_default=True),
        dict(
            name="safety_margin",
            help="Room kept free under the budget: a percentage of it or a size (256MiB). "
            "A config fits when peak reserved + CUDA context + margin <= budget.",
            default=defaults.SAFETY_MARGIN_TEXT,
            show_default=True,
        ),
        dict(
            name="warmup_steps",
            help="Optimizer steps before timing (at least 2).",
            type=STEPS,
            default=defaults.WARMUP_STEPS,
            show_default=True,
        ),
        dict(
            name="measure_steps",
            help="Timed optimizer steps, at least.",
            type=STEPS,
            default=defaults.MEASURE_STEPS,
            show_default=True,
        ),
        dict(
            name="measure_seconds",
            help=f"Time steps until the window is at least this long (up to {defaults.MAX_MEASURE_STEPS} steps), "
            f"so that fast configs are timed as steadily as slow ones.",
            type=SECONDS_OR_ZERO,
            default=defaults.MEASURE_SECONDS,
            show_default=True,
        ),
        dict(
            name="probe_timeout",
            help="Kill a probe after this long (e.g. 90s, 10m).",
            type=DURATION,
            default=f"{defaults.PROBE_TIMEOUT_SECONDS:.0f}s",
            show_default=True,
        ),
        dict(name="trust_remote_code", help=REMOTE_CODE_HELP, switch=True),
        dict(
            name="max_compile_seconds",
            help="--compile: skip a config whose compilation takes longer than this [default: no bound].",
            type=SECONDS,
        ),
        dict(
            name="rendezvous",
            help="With --nodes 2 or more: this node's address and a free port, where torchrun's ranks meet; "
            "start `autotune node --rendezvous HOST:PORT` on each other node.",
            type=RENDEZVOUS,
            metavar="HOST:PORT",
            closed="a search over several nodes is started from the command line on its first node.",
        ),
    )
)

# The service's reasons for the flags it does not take.
WORKERS_RUN_IT = "queue workers run the searches, not a launcher of the request's."
ITS_DATABASE = "the service's operator chooses the database (autotune serve --db)."
ITS_JSON = "the service always answers in JSON."


DB = Flag("db", DB_HELP, part=Part.OUTPUT, metavar="URL", closed=ITS_DATABASE)


def json_flag(what: str) -> Flag:
    return Flag("json", what, part=Part.OUTPUT, switch=True, param="as_json", closed=ITS_JSON)


# -- autotune search ----------------------------------------------------------------------------------
SEARCH = (
    Flag(
        "model",
        "Hub id, gpt2-family name, or a local directory with config.json [required unless --from names it].",
        part=Part.WHAT,
        reads=True,
    ),
    Flag("gpu_budget", BUDGET_HELP, part=Part.WHAT, required=True),
    Flag(
        "from",
        "Keep the recipe of your own TRL, axolotl or LLaMA-Factory config (or a TrainingArguments JSON): "
        "its model, sequence length, effective batch, LoRA, optimizer and evaluation; the free levers are "
        "searched, and `autotune best --update FILE` writes the winner back into it (docs/tools.md).",
        part=Part.LAUNCH,
        metavar="FILE",
        param="from_file",
        closed="the service reads no file a client names: send the file's recipe as fields (model, block_sizes, "
        "effective_batch, peft, optimizers, ...), or run `autotune search --from FILE` where the file is.",
    ),
    *SPACE,
    Flag(
        "strategy",
        "predictive (a speed model refitted after each probe), frontier, tpe, grid (OOM-pruned) or grid-full.",
        part=Part.SEARCH,
        default=defaults.STRATEGY,
        show_default=True,
    ),
    Flag(
        "max_trials",
        "Stop after this many probes (reused and skipped ones are free).",
        part=Part.SEARCH,
        type=COUNT,
    ),
    Flag(
        "timeout",
        "End the whole command within this long (e.g. 30m), confirmation included: the probe in flight is "
        "stopped at the deadline, none starts that could not end before it; the same command goes on.",
        part=Part.SEARCH,
        type=DURATION,
    ),
    Flag("patience", "Stop after this many probes without a better config.", part=Part.SEARCH, type=COUNT),
    Flag("study", "Study name; the same name resumes [default: MODEL-BUDGET].", part=Part.SEARCH),
    Flag("fresh", "Probe again even where a stored result could be reused.", part=Part.SEARCH, switch=True),
    Flag(
        "predict",
        "Estimate every candidate's memory first (no GPU needed): skip hopeless ones, order the rest.",
        part=Part.SEARCH,
        negatable=True,
        default=True,
        show_default=True,
    ),
    Flag(
        "confirm",
        "Before saying the pick, measure the configs within noise of the best again until it is told "
        "apart or declared a tie.",
        part=Part.SEARCH,
        negatable=True,
        default=True,
        show_default=True,
    ),
    Flag(
        "predict_margin",
        "Skip a config only if predicted over the budget by more than this share of it; within it, a "
        "probe decides [default: 0.1 on CUDA; 0 on CPU, where the estimate equals the probe to the byte].",
        part=Part.SEARCH,
        type=REAL,
    ),
    *PROBE_SETTINGS,
    Flag(
        "workers",
        "Search in N worker processes on this machine: one per GPU (each gets one CUDA_VISIBLE_DEVICES entry), "
        "or N CPU workers with --device cpu (at most one per core). Other machines join with `autotune worker`.",
        part=Part.LAUNCH,
        type=click.IntRange(min=1),
        closed="queue workers run the searches: start more of them (autotune worker --queue) to search faster.",
    ),
    Flag(
        "launcher",
        "Where the --workers start: local (this machine), ray (Ray tasks on a cluster: --ray-address) or "
        "slurm (a Slurm job array: --slurm-*); every worker pulls probes from the database (--db).",
        part=Part.LAUNCH,
        type=click.Choice(LAUNCHERS),
        default="local",
        show_default=True,
        closed="queue workers run the searches: start them where the GPUs are (autotune worker --queue).",
    ),
    Flag(
        "ray_address",
        "The Ray cluster's head [default: $RAY_ADDRESS, else the cluster `ray start` runs here].",
        part=Part.LAUNCH,
        metavar="HOST:PORT",
        closed=WORKERS_RUN_IT,
    ),
    Flag(
        "slurm_partition",
        "The partition the workers' job array runs in.",
        part=Part.LAUNCH,
        closed=WORKERS_RUN_IT,
    ),
    Flag(
        "slurm_time",
        "The job's time limit, as sbatch takes it (e.g. 2:00:00).",
        part=Part.LAUNCH,
        closed=WORKERS_RUN_IT,
    ),
    Flag(
        "slurm_parallel",
        "Array tasks running at once (sbatch --array ...%K).",
        part=Part.LAUNCH,
        type=COUNT,
        closed=WORKERS_RUN_IT,
    ),
    Flag(
        "slurm_option",
        "One more sbatch option for the job script (repeatable), e.g. --account=ml.",
        part=Part.LAUNCH,
        multiple=True,
        closed=WORKERS_RUN_IT,
    ),
    Flag(
        "dry_run",
        "With --launcher slurm: print the workers' job script and submit nothing.",
        part=Part.LAUNCH,
        switch=True,
        closed="the service submits; `autotune search --dry-run` prints a job script on the command line.",
    ),
    Flag(
        "oversubscribe",
        "Allow more CPU workers than cores (up to 4 per core): their timings then share the cores.",
        part=Part.LAUNCH,
        switch=True,
        closed="queue workers run the searches, one probe at a time each.",
    ),
    Flag(
        "heartbeat",
        f"Seconds between a worker's heartbeats; a worker silent for {defaults.STALE_BEATS} of them is presumed "
        f"dead and its probe retried.",
        part=Part.SEARCH,
        type=SECONDS,
        default=defaults.HEARTBEAT_SECONDS,
        show_default=True,
        param="heartbeat_seconds",
    ),
    DB,
    json_flag("Print the outcome as one JSON object (progress goes to stderr)."),
)

# -- autotune plan ------------------------------------------------------------------------------------
PLAN = (
    Flag("model", MODEL_HELP, part=Part.WHAT, required=True, reads=True),
    Flag(
        "gpu",
        "The card to plan for, by name (h100, a100-40gb, rtx4090, l4, ...: see `autotune plan --gpu list`), "
        "or cpu (what CPU probes account); several (h100,a100-80gb,l4) or all to weigh which to rent, "
        "with --gpus counts and the run's --tokens.",
        part=Part.COMMAND,
        param="gpu_name",
    ),
    Flag(
        "gpu_budget",
        "Memory to fit in (8GiB, ...) [default: the card's memory]; with --gpu cpu, required.",
        part=Part.WHAT,
    ),
    *(row for row in SPACE if row.name != "gpus"),
    Flag(
        "gpus",
        GPUS_HELP + " Several counts (1,2,4,8) weigh each with --tokens.",
        default="1",
        show_default=True,
        param="gpu_counts",
    ),
    Flag(
        "tokens",
        "The whole run's tokens (100M, 1.5B): each card and count's run time, and with prices its cost.",
        part=Part.COMMAND,
    ),
    Flag(
        "epochs",
        "Instead of --tokens: the run trains --dataset's training split this many times (1, 3, 0.5), its "
        "tokens counted with the model's tokenizer (or --tokenizer).",
        part=Part.COMMAND,
        type=PASSES,
    ),
    Flag(
        "prices",
        "Prices per GPU hour: SkyPilot's catalog CSV (catalogs/v7/<cloud>/vms.csv) or card,price_per_gpu_hour"
        "[,spot_per_gpu_hour] [default: the table shipped with autotune, dated, each row's source named].",
        part=Part.COMMAND,
        reads=True,
        closed="the service reads no file a client names; it prices from its operator's table.",
    ),
    Flag(
        "sort",
        "Order the cards and counts by the run's cost or its time.",
        part=Part.COMMAND,
        type=click.Choice(("cost", "time")),
        default="cost",
        show_default=True,
    ),
    Flag(
        "format",
        "With --tokens: a table, or csv for a pipeline (--json: one object).",
        part=Part.OUTPUT,
        type=click.Choice(("table", "csv")),
        default="table",
        show_default=True,
        param="fmt",
    ),
    Flag("safety_margin", MARGIN_HELP, part=Part.COMMAND, default=defaults.SAFETY_MARGIN_TEXT, show_default=True),
    Flag(
        "exact",
        "Trace every candidate instead of each group's smallest and largest micro-batch (interpolating between).",
        part=Part.COMMAND,
        switch=True,
    ),
    Flag(
        "study",
        "A study whose measurements to show beside the predictions [default: the latest of this model and "
        "space on such a card, if any].",
        part=Part.COMMAND,
    ),
    Flag("top", "Show only the first N rows of the table.", part=Part.COMMAND, type=click.IntRange(min=1)),
    Flag(
        "plot",
        "Also draw the predicted points, as `autotune plot` draws a study's.",
        part=Part.OUTPUT,
        param="plot_file",
        closed="the service writes no files; draw the plan from its JSON.",
    ),
    Flag(
        "timeout",
        "Give up tracing one configuration after this long.",
        part=Part.COMMAND,
        default=f"{defaults.ESTIMATE_TIMEOUT_SECONDS:.0f}s",
        show_default=True,
        param="timeout_text",
    ),
    Flag("no_cache", "Trace again even where an estimate is cached.", part=Part.COMMAND, switch=True),
    Flag("trust_remote_code", REMOTE_CODE_HELP, part=Part.COMMAND, switch=True),
    Flag("stack", STACK_HELP, part=Part.COMMAND, param="stack_text"),
    DB,
    json_flag("Print the plan as one JSON object."),
)

# -- autotune estimate and autotune probe --------------------------------------------------------------
ESTIMATE = (
    *CONFIG,
    Flag(
        "gpu_budget",
        "Also say whether it fits in this much memory: 8GiB, 7.5GiB, 8192MiB, 8GB or bytes.",
        part=Part.WHAT,
    ),
    Flag("safety_margin", MARGIN_HELP, part=Part.COMMAND, default=defaults.SAFETY_MARGIN_TEXT, show_default=True),
    Flag(
        "device_type",
        "cuda: predict a GPU run; cpu: predict what a CPU probe accounts.",
        part=Part.COMMAND,
        default="cuda",
        show_default=True,
    ),
    Flag(
        "timeout",
        "Give up tracing after this long.",
        part=Part.COMMAND,
        type=DURATION,
        default=f"{defaults.ESTIMATE_TIMEOUT_SECONDS:.0f}s",
        show_default=True,
        param="timeout_text",
    ),
    Flag("no_cache", "Trace again even if this estimate is cached.", part=Part.COMMAND, switch=True),
    Flag("trust_remote_code", REMOTE_CODE_HELP, part=Part.COMMAND, switch=True),
    Flag("stack", STACK_HELP, part=Part.COMMAND, param="stack_text", callback=_stack_text),
    json_flag("Print the estimate as one JSON object."),
)
PROBE = (
    *CONFIG,
    Flag("gpu_budget", BUDGET_HELP, part=Part.WHAT, required=True),
    *PROBE_SETTINGS,
    json_flag("Print the result as one JSON object."),
)

# The tables a request to the service may be read with, by command.
REQUESTS = {"search": SEARCH, "plan": PLAN, "estimate": ESTIMATE}
# The fields, in any of them, that name something to read.
READ_FIELDS = frozenset(row.name for rows in REQUESTS.values() for row in rows if row.reads)

# `autotune best --format`'s choices (BestConfig.render's formats), which the service's /best and
# /v1/answers answer in too.
BEST_FORMATS = ("json", "yaml", "trainer-args", "cli", "accelerate", "trl", "axolotl", "llamafactory", "lightning")
