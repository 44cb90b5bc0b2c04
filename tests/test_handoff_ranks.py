"""A multi-GPU winner's hand-off (autotune/handoff/ranks.py), checked against what reads it: accelerate
1.15's config loader and launcher (the file becomes the FSDP_* environment each rank's
FullyShardedDataParallelPlugin reads), transformers 5.24's TrainingArguments (its `fsdp_plugin_args`
are what Trainer gives the plugin), and, in the slow test, a real 2-rank `accelerate launch` on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.levers.config import ProbeConfig
from autotune.handoff import ranks
from autotune.store import open_store
from tests.helpers.models import TINY_GPT2
from tests.helpers.store import ENV, config, make_study, result
from tests.helpers.store import best_of

FSDP = [("fsdp", True, False), ("fsdp-grad-op", False, False), ("fsdp-offload", True, True)]


def winner(strategy: str | None = "fsdp", gpus: int = 2, device_type: str = "cuda", **changes):
    values: dict = {"grad_accum": 2, "precision": "bf16", "checkpointing": True, **changes}
    return best_of(ProbeConfig("gpt2", 4, 128, gpus=gpus, strategy=strategy, **values), device_type)


def launched_environment(yaml_file: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file F` gives each rank, worked out by accelerate's
    own launcher code, short of starting the processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(yaml_file), "train.py"])
    args, _, _ = _validate_launch_command(args)
    environment = prepare_multi_gpu_env(args)
    assert args.nproc_per_node == "2"
    return {k: v for k, v in environment.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


@pytest.mark.parametrize("strategy, reshard, offload", FSDP)
def test_the_accelerate_file_gives_each_rank_the_fsdp2_plugin_the_probe_measured(
    tmp_path, monkeypatch, strategy, reshard, offload
):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    yaml_file = tmp_path / "accelerate_config.yaml"
    yaml_file.write_text(winner(strategy).accelerate_yaml())
    loaded = load_config_from_file(str(yaml_file))
    assert isinstance(loaded, ClusterConfig) and loaded.distributed_type == DistributedType.FSDP
    assert (loaded.num_processes, loaded.mixed_precision) == (2, "bf16")
    assert loaded.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "GPT2Block"

    environment = launched_environment(yaml_file)
    assert environment["ACCELERATE_USE_FSDP"] == "true" and environment["ACCELERATE_MIXED_PRECISION"] == "bf16"
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is reshard
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") is offload
    assert plugin.transformer_cls_names_to_wrap == ["GPT2Block"]
    # transformers' checkpointing is the probe's (the script turns it on); accelerate's would add a second one.
    assert plugin.activation_checkpointing is False


def test_a_ddp_file_launches_multi_gpu_processes_without_fsdp(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    yaml_file = tmp_path / "accelerate_config.yaml"
    yaml_file.write_text(winner("ddp", precision="fp16").accelerate_yaml())
    loaded = load_config_from_file(str(yaml_file))
    assert loaded.distributed_type == DistributedType.MULTI_GPU and loaded.fsdp_config == {}
    assert (loaded.num_processes, loaded.mixed_precision) == (2, "fp16")
    assert "ACCELERATE_USE_FSDP" not in launched_environment(yaml_file)


@pytest.mark.parametrize("strategy, reshard, offload", FSDP)
def test_training_arguments_take_the_fsdp_config_and_give_trainer_the_same_plugin(
    monkeypatch, tmp_path, strategy, reshard, offload
):
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "")  # (both set it in os.environ: restored after the test)
    best = winner(strategy, device_type="cpu")
    kwargs = best.trainer_kwargs()
    assert kwargs["per_device_train_batch_size"] == 4 and kwargs["gradient_accumulation_steps"] == 2
    assert kwargs["activation_checkpointing"] is True and kwargs["fsdp_config"]["activation_checkpointing"] is False
    args = best.training_arguments(str(tmp_path))
    assert args.fsdp is True and args.fsdp_plugin_args["fsdp_version"] == 2
    # Trainer builds accelerate's plugin from exactly these (Trainer.create_accelerator_and_postprocess).
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    assert plugin.reshard_after_forward is reshard and plugin.transformer_cls_names_to_wrap == ["GPT2Block"]
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") is offload


def test_ddp_keeps_the_probes_find_unused_parameters_and_one_gpu_adds_nothing(tmp_path):
    ddp = winner("ddp", device_type="cpu")
    # Trainer would turn find_unused_parameters on for a model without checkpointing; the probe's DDP has it off.
    assert ddp.trainer_kwargs()["ddp_find_unused_parameters"] is False
    assert ddp.training_arguments(str(tmp_path)).ddp_find_unused_parameters is False
    single = winner(None, gpus=1).trainer_kwargs()
    assert not {"fsdp", "fsdp_config", "ddp_find_unused_parameters"} & set(single)
    assert winner(None, gpus=1).accelerate_config()["distributed_type"] == "NO"


def test_the_layer_table_is_transformers_no_split_modules():
    import transformers
    from transformers.models.auto import modeling_auto

    mappings = [
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    ]
    for model_type, layers in ranks.LAYER_CLASSES.items():
        classes = [mapping[model_type] for mapping in mappings if model_type in mapping]
        assert classes, model_type
        for name in classes:
            assert tuple(getattr(transformers, name)._no_split_modules) == layers, (model_type, name)


def test_the_layer_class_is_read_offline_or_left_to_accelerate(tmp_path):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY_GPT2))
    assert ranks.layer_classes(ProbeConfig(str(tiny), 1, 64)) == ("GPT2Block",)
    assert ranks.layer_classes(ProbeConfig("openai-community/gpt2-medium", 1, 64)) == ("GPT2Block",)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "pegasus"}))
    best = best_of(ProbeConfig(str(other), 2, 64, gpus=2, strategy="fsdp"))
    # Not in the table: the key is left out and accelerate wraps the model's _no_split_modules, as the probe did.
    assert "fsdp_transformer_layer_cls_to_wrap" not in best.accelerate_config()["fsdp_config"]
    assert "transformer_layer_cls_to_wrap" not in best.trainer_kwargs()["fsdp_config"]
    assert "accelerate wraps the model's _no_split_modules" in best.accelerate_yaml()


def test_the_text_says_the_effective_batch_and_how_to_launch():
    best = winner("fsdp", gpus=4)
    text = str(best)
    assert "effective batch = micro_batch 4 x grad_accum 2 x 4 = 32" in text
    assert "accelerate launch --config_file accelerate_config.yaml train.py" in text
    assert "torchrun --nproc-per-node 4 train.py" in text
    assert "= 32 sequences per optimizer step" in best.accelerate_yaml()
    document = json.loads(best.render("trainer-args"))
    assert document["effective_batch"] == 32
    assert document["launch"]["torchrun"] == "torchrun --nproc-per-node 4 train.py"
    assert best.launch_command("run_clm.py", launcher="torchrun") == "torchrun --nproc-per-node 4 run_clm.py"
    assert any("accelerate launch --config_file accelerate_config.yaml run_clm.py" in c for c in best.cli_caveats())
    # On CPU, accelerate's multi-process launcher does not tell the ranks: the environment does.
    assert winner("ddp", device_type="cpu").launch_command().startswith("ACCELERATE_USE_CPU=true accelerate launch")


def test_best_format_accelerate_prints_the_file(tmp_path):
    db = tmp_path / "results.db"
    with open_store(db) as store:
        study = make_study(store, "ranks")
        store.record_probe(
            study.id,
            config(4, gpus=2, strategy="fsdp-grad-op", precision="bf16"),
            result("ok"),
            env_fingerprint=ENV.fingerprint(),
        )
    out = CliRunner().invoke(
        cli, ["best", "--study", "ranks", "--db", str(db), "--format", "accelerate"], catch_exceptions=False
    )
    assert out.exit_code == 0, out.output
    assert 'distributed_type: "FSDP"' in out.stdout and "  fsdp_reshard_after_forward: false" in out.stdout
    assert "num_processes: 2" in out.stdout and 'mixed_precision: "bf16"' in out.stdout


_TRAIN_SCRIPT = """
import json, sys, torch, transformers
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule

accelerator = Accelerator()
# accelerate shards only on GPUs (on CPU its state is MULTI_CPU and prepare() leaves FSDP out): apply its
# FSDP2 wrapping itself, with the plugin the launcher's environment (the config file) describes.
plugin = FullyShardedDataParallelPlugin()
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config)
model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
accelerator.state.fsdp_plugin = plugin
plugin.set_auto_wrap_policy(model)
model = fsdp2_prepare_model(accelerator, model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(accelerator.process_index)
losses = []
for _ in range(3):
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
print("RANK " + json.dumps({"rank": accelerator.process_index, "world": accelerator.num_processes, "units": units,
                            "reshard": plugin.reshard_after_forward, "losses": losses}), flush=True)
"""


@pytest.mark.slow
def test_two_ranks_train_from_the_handed_off_file(tmp_path):
    """`accelerate launch --config_file` of an FSDP winner's file starts two CPU ranks that shard and train."""
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_GPT2))
    best = best_of(ProbeConfig(str(model), 2, 32, gpus=2, strategy="fsdp-grad-op", checkpointing=True), "cpu")
    (tmp_path / ranks.ACCELERATE_CONFIG_FILE).write_text(best.accelerate_yaml())
    (tmp_path / "train.py").write_text(_TRAIN_SCRIPT)
    command = best.launch_command(f"train.py {model}")
    assert command.startswith("ACCELERATE_USE_CPU=true accelerate launch --config_file")
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    # (Its own temporary directory: torch's elastic agent leaves a torchelastic_* log directory there.)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run(
        [accelerate, *command.split()[2:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    # (the ranks share one stdout: their lines may run together)
    reports = [json.JSONDecoder().raw_decode(part)[0] for part in proc.stdout.split("RANK ")[1:]]
    assert proc.returncode == 0 and len(reports) == 2, proc.stdout + proc.stderr[-3000:]
    assert sorted(r["rank"] for r in reports) == [0, 1] and {r["world"] for r in reports} == {2}
    for report in reports:
        assert report["reshard"] is False and report["units"].count("FSDPGPT2Block") == TINY_GPT2["n_layer"]
        assert len(report["losses"]) == 3 and all(0 < loss < 100 for loss in report["losses"])
