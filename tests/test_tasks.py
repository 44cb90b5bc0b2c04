"""Tasks other than causal LM: each family is built as its task's real class, probed, estimated to
the byte, and searched; and what cannot be trained as asked is refused in one line.
(`autotune train` per task: tests/train/test_tasks.py.)"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import resolve_model
from autotune.search.space import SearchSpace, single_config
from autotune.levers.tasks import Task, infer_task, task_fields, task_note, tell_task
from tests.helpers.cli import assert_usage_error, invoke
from tests.helpers.models import TINY_GPT2, write_model_dir
from tests.helpers.tiny_tasks import TASK_OF, TINY, write_tiny

GiB = 2**30


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tasks")
    return {family: str(write_tiny(root, family)) for family in TINY}


# -- telling the task ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_task_comes_from_the_architectures(family):
    assert infer_task(TINY[family]) == TASK_OF[family]


@pytest.mark.parametrize(
    "config, task",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, Task.CAUSAL_LM),
        ({"architectures": ["LlamaForCausalLM"]}, Task.CAUSAL_LM),
        # bart-large names the bare model, and old T5 configs a "LMHeadModel": encoder-decoders are seq2seq.
        ({"architectures": ["BartModel"], "is_encoder_decoder": True}, Task.SEQ2SEQ),
        ({"architectures": ["T5WithLMHeadModel"], "is_encoder_decoder": True}, Task.SEQ2SEQ),
        ({"architectures": ["BertForTokenClassification"]}, None),
        ({"architectures": ["BertForMaskedLM", "BertForSequenceClassification"]}, None),
        ({}, None),
        # No head named: the model type tells where it is one task to everyone, and only there.
        ({"model_type": "gpt2"}, Task.CAUSAL_LM),
        ({"model_type": "llama", "architectures": ["LlamaModel"]}, Task.CAUSAL_LM),
        ({"model_type": "t5"}, Task.SEQ2SEQ),
        ({"model_type": "bert"}, None),
        ({"model_type": "roberta", "architectures": ["RobertaModel"]}, None),
        ({"model_type": "gpt2", "architectures": ["GPT2ForTokenClassification"]}, None),
    ],
)
def test_what_the_architectures_cannot_tell_is_none(config, task):
    assert infer_task(config) == task


def test_a_config_saved_without_architectures_is_searched_as_its_model_types_task(tmp_path):
    # As GPT2Config(...).save_pretrained(dir) writes it: no architectures (checked against transformers
    # itself in the T5 test below, which imports it anyway).
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({k: v for k, v in TINY_GPT2.items() if k != "architectures"}))
    spec = resolve_model(str(gpt2))
    space = SearchSpace.build(spec, block_sizes=(64,))
    assert {c.task for c in space.candidates()} == {"causal-lm"} and "task" not in space.to_dict()
    assert single_config(spec, micro_batch=1, block_size=64).task == "causal-lm"
    told = tell_task(spec.config)
    assert (told.task, told.assumed) == (Task.CAUSAL_LM, True)
    assert task_note(spec.config) == (
        "task causal-lm assumed from model type 'gpt2' (its config.json names no task "
        "head); pass --task to train it as another"
    )
    assert task_note(spec.config, requested="causal-lm") is None  # said by the user: nothing assumed
    assert task_note(TINY_GPT2) is None and not tell_task(TINY_GPT2).assumed  # its architectures say it
    # A BERT-like config is trained as several tasks: still refused, with why.
    with pytest.raises(
        BadInput,
        match=r"cannot tell its task from its config.json \(no architectures, and a bert model "
        r"is trained as masked-lm or classification alike\); pass --task",
    ):
        single_config(
            resolve_model(str(write_tiny(tmp_path, "bert-mlm", architectures=None))), micro_batch=1, block_size=32
        )


@pytest.mark.slow  # (no process: seconds of imports and two real steps)
def test_a_t5_config_written_by_transformers_trains_with_a_decoder_start_token(tmp_path):
    """transformers 5.24's T5Config(...) has no decoder_start_token_id: the probe's config starts the
    decoder at the pad token, as T5 does, and two real steps run (the estimator and `autotune train`
    build through the same task_config)."""
    import torch
    from transformers import GPT2Config, T5Config

    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")  # what the test above writes by hand
    assert tell_task(json.loads((tmp_path / "gpt2" / "config.json").read_text())).assumed

    from autotune.probe.step import ProbeStep, build_random_model, make_optimizer

    T5Config(vocab_size=1024, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, pad_token_id=5).save_pretrained(
        tmp_path / "t5"
    )
    spec = resolve_model(str(tmp_path / "t5"))
    assert "decoder_start_token_id" not in spec.config
    config = single_config(spec, micro_batch=2, block_size=32, target_length=8)
    assert (config.task, config.target_length) == ("seq2seq", 8)
    cpu = torch.device("cpu")
    model, hf_config = build_random_model(spec, config, cpu, False)
    assert hf_config.decoder_start_token_id == 5 and model.config.decoder_start_token_id == 5
    step = ProbeStep(model, make_optimizer(model, cpu), config, cpu, hf_config.vocab_size)
    losses = [step(), step()]
    assert all(loss > 0 for loss in losses)
    # No pad token: the bos token, else 0.
    from autotune.probe.step import task_config

    assert task_config(T5Config(pad_token_id=None, bos_token_id=3), config).decoder_start_token_id == 3
    assert task_config(T5Config(pad_token_id=None), config).decoder_start_token_id == 0
    assert task_config(T5Config(decoder_start_token_id=7), config).decoder_start_token_id == 7


def test_task_fields_defaults_and_refusals():
    t5 = TINY["t5"]
    assert task_fields(t5, "t5", max_positions=256) == {"task": "seq2seq", "target_length": 128}
    assert task_fields(t5, "t5", max_positions=64) == {"task": "seq2seq", "target_length": 64}
    assert task_fields(TINY["bert-classification"], "b") == {"task": "classification", "num_labels": 3}
    assert task_fields(TINY["bert-classification"], "b", num_labels=7)["num_labels"] == 7
    assert task_fields(TINY["bert-mlm"], "b", task="classification") == {"task": "classification", "num_labels": 2}
    with pytest.raises(BadInput, match="--target-length 300 is above t5's maximum of 256 positions"):
        task_fields(t5, "t5", target_length=300, max_positions=256)
    with pytest.raises(BadInput, match="--target-length is for --task seq2seq"):
        task_fields(TINY_GPT2, "g", target_length=32)
    with pytest.raises(BadInput, match="--num-labels is for --task classification"):
        task_fields(t5, "t5", num_labels=3)
    with pytest.raises(BadInput, match="cannot tell its task .* pass --task"):
        task_fields({"model_type": "bert"}, "b")
    with pytest.raises(BadInput, match="--task 'summarize' is unknown"):
        task_fields(t5, "t5", task="summarize")


def test_a_causal_lm_config_keeps_the_key_it_had_before_tasks():
    """Stored probes are found by key: the task fields at their causal-LM values leave it as it was."""
    config = ProbeConfig("gpt2", 8, 512, grad_accum=4, precision="bf16")
    later = (
        "task",
        "target_length",
        "num_labels",
        "weights",
        "peft",
        "trainer",
        "compile",
        "allocator",
        "liger",
        "eval_batch",
        "auto_eval_batch",
        "eval_logits",
        "eval_accumulation_steps",
        "generation_max_length",
        "generation_num_beams",
        "gpus",
        "strategy",
        "nodes",
        "lengths",
        "sampling",
        "padding_free",
    )
    before = {k: v for k, v in config.to_dict().items() if k not in later}
    canonical = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert config.key() == "p1-" + hashlib.sha256(canonical.encode()).hexdigest()[:20]
    seq2seq = ProbeConfig("t5", 8, 512, task="seq2seq", target_length=128)
    assert len({config.key(), seq2seq.key(), replace(seq2seq, target_length=64).key()}) == 3
    # A speed lever switched on is another config; off, the key is the one it always was.
    assert (
        len(
            {
                config.key(),
                replace(config, compile=True).key(),
                replace(config, allocator="expandable").key(),
                replace(config, liger=True).key(),
                replace(config, precision="tf32").key(),
            }
        )
        == 5
    )
    # So is a run on several ranks, and each way of sharing it.
    assert (
        len(
            {
                config.key(),
                replace(config, gpus=2).key(),
                replace(config, gpus=2, strategy="fsdp").key(),
                replace(config, gpus=2, nodes=2).key(),
            }
        )
        == 4
    )
    # So is an evaluation: another run, another key.
    assert (
        len(
            {
                config.key(),
                replace(config, eval_batch=8).key(),
                replace(config, eval_batch=8, eval_logits="kept", eval_accumulation_steps=1).key(),
            }
        )
        == 3
    )


def test_a_config_refuses_fields_its_task_has_no_use_for():
    with pytest.raises(BadInput, match="--target-length must be a whole number of at least 1 for --task seq2seq"):
        ProbeConfig("t5", 1, 64, task="seq2seq")
    with pytest.raises(BadInput, match="--num-labels is for --task classification, not causal-lm"):
        ProbeConfig("gpt2", 1, 64, num_labels=2)
    seq2seq = ProbeConfig("t5", 2, 64, grad_accum=3, task="seq2seq", target_length=16)
    assert seq2seq.tokens_per_step == 2 * 3 * (64 + 16) and seq2seq.label() == "mb2x3 blk64+16 fp32 no-ckpt sdpa"


def test_the_space_carries_the_task_and_keeps_old_studies_matching(models):
    t5 = SearchSpace.build(resolve_model(models["t5"]), block_sizes=(64,), target_length=32)
    assert {(c.task, c.target_length) for c in t5.candidates()} == {("seq2seq", 32)}
    assert t5.to_dict()["task"] == "seq2seq" and t5.to_dict()["target_length"] == 32
    # A causal-LM space is stored as before tasks: a study finished then still answers from the database.
    gpt2 = SearchSpace.build(resolve_model("gpt2"))
    assert "task" not in gpt2.to_dict() and gpt2.candidates()[0].task == "causal-lm"


# -- probing, estimating and searching every family ----------------------------------------------


def _built_parameters(config_json: dict, task: str, num_labels: int | None) -> int:
    """Parameters of the task's class built by transformers itself from the same config (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

    cls = {
        "seq2seq": AutoModelForSeq2SeqLM,
        "classification": AutoModelForSequenceClassification,
        "masked-lm": AutoModelForMaskedLM,
    }[task]
    fields = dict(config_json)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if num_labels is not None:
        hf_config.num_labels = num_labels
    with torch.device("meta"):
        return sum(p.numel() for p in cls.from_config(hf_config).parameters())


@pytest.fixture(scope="module")
def runner(probe_runner):
    from autotune.probe import ProbeSettings

    return probe_runner(ProbeSettings(device="cpu", warmup_steps=2, measure_steps=1))


@pytest.mark.slow
def test_every_family_probes_as_its_task_class_and_the_estimate_matches_to_the_byte(models, runner, trace_children):
    from autotune.estimate import estimate_memories

    configs = [
        single_config(
            resolve_model(models[family]),
            micro_batch=2,
            block_size=64,
            **({"precision": "bf16", "checkpointing": True} if i % 2 else {}),
        )
        for i, family in enumerate(sorted(TINY))
    ]
    predicted = estimate_memories(configs, device_type="cpu", use_cache=False, children=trace_children)
    measured = [runner.run(c, runner.settings.budget(2 * GiB)) for c in configs]
    for family, config, estimate, probe in zip(sorted(TINY), configs, predicted, measured):
        assert probe.status == "ok", (family, probe.error)
        assert config.task == TASK_OF[family]
        assert probe.parameters == _built_parameters(TINY[family], config.task, config.num_labels), family
        assert (estimate.peak_bytes, estimate.reserved_bytes) == (
            probe.peak_allocated_bytes,
            probe.peak_reserved_bytes,
        ), f"{family} {config.label()}"
    # The whole encoder-decoder is built, not a decoder-only *ForCausalLM (pegasus: about 64% of it).
    pegasus = measured[sorted(TINY).index("pegasus")]
    assert pegasus.parameters > 1.4 * _decoder_only_parameters(TINY["pegasus"])


def _decoder_only_parameters(config_json: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config_json)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_a_tiny_search_of_every_family_finishes_with_a_pick(models, runner, tmp_path):
    """One probe process for all seven searches: each a real search, stored, with a winner. (No
    confirmation round: its windows are processes of their own, tests/search/test_process_noise.py.)"""
    from autotune.search import SearchOptions
    from autotune.search import preflight, run_search
    from tests.helpers.fakes import request
    from autotune.store import open_store

    budget = 1 * GiB
    # (The runner is the test worker's, shared with the modules it ran before this one.)
    started, retired = runner.children_started, list(runner.retired)
    with open_store(tmp_path / "tasks.db") as store:
        for family in sorted(TINY):
            spec = resolve_model(models[family])
            space = SearchSpace.build(
                spec,
                micro_batches=(1, 2),
                block_sizes=(32,),
                precisions=("fp32",),
                checkpointing=(False, True),
                attentions=("sdpa",),
                effective_batch=2,
                **({"target_length": 16} if TASK_OF[family] == "seq2seq" else {}),
            )
            options = SearchOptions(study=family, predict=False, confirm=False)
            searched = preflight(request(space, spec, budget, budget // 20, options), runner)
            outcome = run_search(searched, runner, store)
            assert outcome.best is not None, family
            assert outcome.best.config.task == TASK_OF[family] and outcome.study.status == "finished"
            assert len(store.probes(family)) == 4
        # A study is one task: searching it again as another is refused before anything is written.
        spec = resolve_model(models["bert-mlm"])
        space = SearchSpace.build(
            spec,
            micro_batches=(1, 2),
            block_sizes=(32,),
            precisions=("fp32",),
            checkpointing=(False, True),
            attentions=("sdpa",),
            effective_batch=2,
            task="classification",
        )
        with pytest.raises(
            BadInput,
            match="study 'bert-mlm' measured task masked-lm, not task classification, num_labels 2: its leaderboard",
        ):
            run_search(
                request(space, spec, budget, budget // 20, SearchOptions(study="bert-mlm", predict=False)),
                runner,
                store,
            )
        assert len(store.probes("bert-mlm")) == 4
        # A model whose class lacks a kernel (deberta has no sdpa) and cannot be traced on fake
        # tensors (it reads values): the kernel's probes are skipped with why, the search goes on
        # without predictions and says so, and every config is settled.
        spec = resolve_model(str(_write_config(tmp_path / "deberta", DEBERTA)))
        space = SearchSpace.build(
            spec, micro_batches=(1,), block_sizes=(32,), precisions=("fp32",), checkpointing=(False,), effective_batch=1
        )
        assert space.attentions == ("sdpa", "eager")
        searched = preflight(
            request(space, spec, budget, budget // 20, SearchOptions(study="deberta", confirm=False)), runner
        )
        outcome = run_search(searched, runner, store)
        assert outcome.best is not None and outcome.best.config.attention == "eager" and not outcome.unmeasured
        skipped = [p for p in store.probes("deberta") if p.config.attention == "sdpa"]
        assert [p.result.status for p in skipped] == ["skipped"]
        assert "attention 'sdpa': this model does not implement it" in skipped[0].result.error
        assert any("memory predictions unavailable" in line for line in outcome.failures)
        # One probe process for every search: none retired, at most one started (none where an
        # earlier test left the worker's child running).
        assert runner.children_started - started <= 1 and runner.retired == retired, runner.retired[len(retired) :]


DEBERTA = {
    "model_type": "deberta-v2",
    "architectures": ["DebertaV2ForSequenceClassification"],
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


def _write_config(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_probe_json_reports_the_task_and_the_parameters_built(models, warm_child):
    proc = invoke(
        "probe",
        "--model",
        models["bart"],
        "--micro-batch",
        "1",
        "--block-size",
        "32",
        "--target-length",
        "8",
        "--gpu-budget",
        "1GiB",
        "--device",
        "cpu",
        "--warmup-steps",
        "2",
        "--measure-steps",
        "2",
        "--measure-seconds",
        "0.3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    # The window is sized by time: at least 0.3 s of steps (a step here takes milliseconds), each timed,
    # up to MAX_MEASURE_STEPS.
    import statistics

    from autotune.vocabulary.defaults import MAX_MEASURE_STEPS

    assert 2 <= data["measured_steps"] == len(data["step_times"]) <= MAX_MEASURE_STEPS
    assert data["measured_seconds"] >= 0.3 or data["measured_steps"] == MAX_MEASURE_STEPS
    assert data["step_seconds"] == statistics.median(data["step_times"]) and data["step_spread"] is not None
    assert data["task"] == "seq2seq" and data["config"]["target_length"] == 8 and data["status"] == "ok"
    assert data["parameters"] == _built_parameters(TINY["bart"], "seq2seq", None)


@pytest.mark.slow
def test_a_task_the_model_has_no_class_for_is_one_line_and_writes_nothing(tmp_path, hermetic_home, warm_child):
    gpt2 = str(write_model_dir(tmp_path / "gpt2"))
    db = tmp_path / "db" / "a.db"
    proc = invoke(
        "search", "--model", gpt2, "--gpu-budget", "1GiB", "--device", "cpu", "--task", "seq2seq", "--db", str(db)
    )
    assert_usage_error(
        proc, "has no seq2seq class in transformers (AutoModelForSeq2SeqLM does not know model type 'gpt2')"
    )
    assert not db.parent.exists() and not (hermetic_home / "autotune.db").exists()
    proc = invoke(
        "probe",
        "--model",
        gpt2,
        "--micro-batch",
        "1",
        "--block-size",
        "32",
        "--gpu-budget",
        "1GiB",
        "--device",
        "cpu",
        "--task",
        "masked-lm",
    )
    assert_usage_error(proc, "has no masked-lm class in transformers")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target-length", "1000"], "--target-length 1000 is above"),
        (["--task", "masked-lm", "--target-length", "8"], "--target-length is for --task seq2seq"),
        (
            ["--task", "translation"],
            "--task 'translation' is unknown; choose from causal-lm, seq2seq, classification, masked-lm",
        ),
    ],
)
def test_task_flags_a_model_cannot_take_are_one_line_before_anything_starts(
    models, tmp_path, hermetic_home, args, needle
):
    db = tmp_path / "db" / "a.db"
    for command in (
        ["search", "--gpu-budget", "1GiB", "--db", str(db)],
        ["estimate"],
        ["probe", "--gpu-budget", "1GiB", "--micro-batch", "1", "--block-size", "32"],
    ):
        if command[0] == "estimate":
            command += ["--micro-batch", "1", "--block-size", "32"]
        assert_usage_error(invoke(*command, "--model", models["t5"], *args), needle)
    assert not db.parent.exists() and not (hermetic_home / "autotune.db").exists()


def test_a_model_whose_task_cannot_be_told_needs_task(tmp_path, hermetic_home):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({k: v for k, v in TINY["bert-mlm"].items() if k != "architectures"}))
    proc = invoke("search", "--model", str(bert), "--gpu-budget", "1GiB", "--device", "cpu")
    assert_usage_error(
        proc,
        "cannot tell its task from its config.json (no architectures, and a bert model is trained "
        "as masked-lm or classification alike); pass --task",
    )
    assert not (hermetic_home / "autotune.db").exists()


# -- the hand-off ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, script, flags",
    [
        ({}, "run_clm.py", "--block_size 512"),
        (
            {"task": "seq2seq", "target_length": 64},
            "run_summarization.py",
            "--max_source_length 512 --max_target_length 64 --pad_to_max_length",
        ),
        (
            {"task": "classification", "num_labels": 3},
            "run_classification.py",
            "--max_seq_length 512 --pad_to_max_length",
        ),
        ({"task": "masked-lm"}, "run_mlm.py", "--max_seq_length 512"),
    ],
)
def test_the_hand_off_names_the_tasks_script_class_and_lengths(hermetic_home, changes, script, flags):
    from autotune import best
    from autotune.store import open_store
    from tests.helpers.store import ENV, config, make_study, result

    with open_store() as store:
        study = make_study(store, "handoff")
        store.record_probe(study.id, config(4, **changes), result(), env_fingerprint=ENV.fingerprint())
    chosen = best("handoff")
    assert (
        chosen.cli_flags()
        == f"--per_device_train_batch_size 4 --gradient_accumulation_steps 8 {flags} --optim adamw_torch_fused"
    )
    document = chosen.trainer_args_document()
    assert document["example_script"] == script and document["task"] == changes.get("task", "causal-lm")
    assert (
        document["auto_class"]
        == {
            "run_clm.py": "AutoModelForCausalLM",
            "run_summarization.py": "AutoModelForSeq2SeqLM",
            "run_classification.py": "AutoModelForSequenceClassification",
            "run_mlm.py": "AutoModelForMaskedLM",
        }[script]
    )
    assert document.get("max_target_length") == changes.get("target_length")
    assert chosen.model_kwargs().get("num_labels") == changes.get("num_labels")
    assert (chosen.block_size, chosen.target_length, chosen.task) == (
        512,
        changes.get("target_length"),
        changes.get("task", "causal-lm"),
    )
    assert f'  example_script: "{script}"' in chosen.yaml()
    assert json.loads(chosen.render("json"))["task"] == changes.get("task", "causal-lm")
