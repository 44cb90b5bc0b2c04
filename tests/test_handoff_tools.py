"""`autotune best --format trl|axolotl|llamafactory|lightning` (autotune/handoff/tools.py): every key each
document emits is one its tool defines, with a value it accepts; TRL's SFTConfig and Lightning's Trainer
take theirs and train three real steps of a tiny GPT-2 on CPU. axolotl and LLaMA-Factory cannot share this
environment (axolotl pins transformers==5.16.1, LLaMA-Factory datasets<=4.0.0): their field lists are
copied below from the source read, file and commit named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.handoff import BestConfig, tools
from autotune.levers.recipes import peft_text
from tests.helpers.store import leaderboard_row

# --- the tools' fields, as their current source defines them --------------------------------------

# axolotl-ai-cloud/axolotl at 067b021c8b87a9e5e380b9173c704cf7340e30f5 (v0.18.0-9): the fields of
# AxolotlInputConfig (src/axolotl/utils/schemas/config.py) and of the mixins it takes the emitted keys from:
# HyperparametersConfig (schemas/training.py), LoraConfig (schemas/peft.py), ModelInputConfig (schemas/model.py);
# the Liger plugin's (src/axolotl/integrations/liger/args.py, LigerArgs).
AXOLOTL_FIELDS = frozenset(
    """
strict resume_from_checkpoint auto_resume_from_checkpoints resize_token_embeddings_to_32x
mean_resizing_embeddings shrink_embeddings embeddings_skip_upcast reinit_weights trainer_cls rl trl vllm ebft
qat quantization reward_model dynamic_checkpoint process_reward_model center_rewards_coefficient num_labels
dpo_use_weighting dpo_label_smoothing precompute_ref_log_probs dpo_use_liger_kernel dpo_padding_free
dpo_loss_type dpo_loss_weights datasets test_datasets shuffle_merged_datasets shuffle_before_merging_datasets
dataset_prepared_path dataset_shard_num dataset_shard_idx skip_prepare_dataset num_dataset_shards_to_save
pretraining_dataset dataset_processes dataset_num_proc dataset_exact_deduplication dataset_keep_in_memory
dataloader_pin_memory dataloader_num_workers dataloader_prefetch_factor dataloader_drop_last
accelerator_config remove_unused_columns push_dataset_to_hub hf_use_auth_token device device_map world_size
local_rank ddp seed ddp_timeout ddp_bucket_cap_mb ddp_broadcast_buffers ddp_find_unused_parameters
do_causal_lm_eval eval_causal_lm_metrics do_bench_eval bench_dataset bench_split metric_for_best_model
greater_is_better loss_watchdog_threshold loss_watchdog_patience gc_steps torch_empty_cache_steps
gc_collect_steps bf16 fp16 fp8 fp8_enable_fsdp_float8_all_gather bfloat16 float16 tf32 float32
gradient_checkpointing gradient_checkpointing_kwargs selective_checkpointing activation_offloading
layer_offloading freeze_mm_modules unfrozen_parameters sequence_len excess_length_strategy eval_sequence_len
min_sample_len max_prompt_len sample_packing sample_packing_group_size sample_packing_bin_size
sample_packing_sequentially sample_packing_mp_start_method eval_sample_packing pad_to_sequence_len
pad_to_multiple_of curriculum_sampling multipack_real_batches batch_flattening use_pose
pose_split_on_token_ids pose_max_context_len pose_num_chunks pretrain_multipack_buffer_size
pretrain_multipack_attn pretraining_sample_concatenation streaming streaming_multipack_buffer_size
xformers_attention sdp_attention flex_attention flex_attn_compile_kwargs flash_attention
flash_attn_cross_entropy flash_attn_fuse_mlp flash_optimum sage_attention eager_attention attn_implementation
gemma4_hybrid_attn_impl large_head_attention flash_attn_d512 sdpa_varlen fused_attn_kernel
experts_implementation quantize_moe_experts scaling_softmax scaling_softmax_factor scaling_softmax_bias
lora_mlp_kernel lora_qkv_kernel lora_o_kernel lora_embedding_kernel chunked_cross_entropy
chunked_cross_entropy_num_chunks use_eaft eaft_alpha eaft_k tiled_mlp tiled_mlp_num_shards
tiled_mlp_use_original_mlp llama4_linearized_experts deepspeed deepcompile fsdp fsdp_config fsdp_version
fp32_norms fp32_norm_classes fsdp_final_state_dict_type val_set_size dp_shard_size dp_replicate_size
sequence_parallel_degree context_parallel_size heads_k_stride ring_attn_func tensor_parallel_size
special_tokens tokens added_tokens_overrides torch_compile torch_compile_backend torch_compile_mode
torch_compile_options max_steps warmup_steps warmup_ratio eval_steps evals_per_epoch eval_strategy save_steps
saves_per_epoch save_strategy save_total_limit save_first_step logging_steps early_stopping_patience
load_best_model_at_end save_only_model use_tensorboard profiler_steps profiler_steps_start
include_tokens_per_second include_tkps neftune_noise_alpha orpo_alpha simpo_gamma cpo_alpha
kto_desirable_weight kto_undesirable_weight rl_beta max_memory gpu_memory_limit low_cpu_mem_usage
chat_template chat_template_jinja chat_template_kwargs eot_tokens default_system_message fix_untrained_tokens
is_preprocess preprocess_iterable total_num_tokens total_supervised_tokens sample_packing_eff_est
axolotl_config_path is_falcon_derived_model is_llama_derived_model is_mistral_derived_model
is_qwen_derived_model plugins generate_samples num_generation_samples generation_max_new_tokens
generation_temperature generation_top_p generation_top_k generation_prompt_ratio generation_do_sample

gradient_accumulation_steps micro_batch_size batch_size eval_batch_size auto_find_batch_size train_on_inputs
group_by_length learning_rate embedding_lr embedding_lr_scale weight_decay optimizer optim_args
optim_target_modules torchdistx_path lr_scheduler lr_scheduler_kwargs lr_quadratic_warmup cosine_min_lr_ratio
cosine_constant_lr_ratio lr_div_factor lr_groups adam_epsilon adam_epsilon2 adam_beta1 adam_beta2 adam_beta3
dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of qgalore_rank qgalore_update_proj_gap
qgalore_scale qgalore_proj_type qgalore_proj_quant qgalore_proj_bits qgalore_proj_group_size
qgalore_cos_threshold qgalore_gamma_proj qgalore_queue_size max_grad_norm num_epochs

load_in_8bit load_in_4bit adapter lora_model_dir lora_r lora_alpha lora_fan_in_fan_out lora_target_modules
lora_target_parameters lora_target_linear lora_modules_to_save lora_rank_pattern lora_alpha_pattern
lora_dropout peft_layers_to_transform peft_layers_pattern peft peft_use_dora peft_use_rslora
peft_layer_replication peft_init_lora_weights peft_trainable_token_indices peft_ensure_weight_tying
peft_autocast_adapter_dtype qlora_sharded_model_loading lora_on_cpu gptq bnb_config_kwargs loraplus_lr_ratio
loraplus_lr_embedding merge_lora merge_method

base_model base_model_config cls_model_config tokenizer_config tokenizer_use_fast tokenizer_legacy
tokenizer_use_mistral_common tokenizer_type processor_type processor_kwargs tokenizer_save_jinja_files
trust_remote_code experimental_skip_move_to_device use_kernels model_quantization_config
model_quantization_config_kwargs use_onebitllms

liger_rope liger_rms_norm liger_rms_norm_gated liger_layer_norm liger_swiglu liger_glu_activation
liger_cross_entropy liger_fused_linear_cross_entropy liger_use_token_scaling
""".split()
)
# FSDPConfig (src/axolotl/utils/schemas/fsdp.py), the fields of `fsdp_config:`.
AXOLOTL_FSDP_FIELDS = frozenset(
    """
fsdp_version activation_checkpointing offload_params sync_module_states cpu_ram_efficient_loading
cpu_offload_pin_memory use_orig_params state_dict_type final_state_dict_type auto_wrap_policy
transformer_layer_cls_to_wrap min_num_params reshard_after_forward mixed_precision_policy
""".split()
)
# attn_implementation's canonical values (schemas/config.py, its description).
AXOLOTL_ATTENTIONS = {
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flex_attention",
    "xformers",
    "sage",
    "fp8",
}

# hiyouga/LLaMA-Factory at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30 (v0.9.5-54), src/llamafactory/hparams/:
# model_args.py (BaseModelArguments, QuantizationArguments, ModelArguments), data_args.py (DataArguments),
# finetuning_args.py (FreezeArguments, LoraArguments, FinetuningArguments), training_args.py (its own fields).
LLAMAFACTORY_FIELDS = frozenset(
    """
model_name_or_path adapter_name_or_path adapter_folder cache_dir use_fast_tokenizer resize_vocab
split_special_tokens add_tokens add_special_tokens new_special_tokens_config init_special_tokens
model_revision low_cpu_mem_usage rope_scaling flash_attn shift_attn mixture_of_depths use_unsloth
use_unsloth_gc enable_liger_kernel moe_aux_loss_coef disable_gradient_checkpointing use_reentrant_gc
upcast_layernorm upcast_lmhead_output train_from_scratch infer_backend offload_folder use_kv_cache
use_v1_kernels infer_dtype hf_hub_token ms_hub_token om_hub_token print_param_status trust_remote_code
quantization_method quantization_bit quantization_type double_quantization quantization_device_map
compute_dtype device_map model_max_length block_diag_attn
template dataset eval_dataset dataset_dir media_dir cutoff_len train_on_prompt mask_history streaming
buffer_size mix_strategy interleave_probs overwrite_cache preprocessing_batch_size preprocessing_num_workers
max_samples eval_num_beams ignore_pad_token_for_loss val_size eval_on_each_dataset packing neat_packing
tool_format default_system enable_thinking preserve_thinking tokenized_path data_shared_file_system
freeze_trainable_layers freeze_trainable_modules freeze_extra_modules
additional_target lora_alpha lora_dropout lora_rank lora_target loraplus_lr_ratio loraplus_lr_embedding
use_rslora use_dora pissa_init pissa_iter pissa_convert create_new_adapter
pure_bf16 stage finetuning_type use_llama_pro use_adam_mini use_mca use_megatron_bridge megatron_bridge_args
use_hyper_parallel hyper_parallel_args hyper_parallel_cp_size use_muon use_dft_loss use_asft_loss asft_alpha
use_eaft_loss eaft_alpha freeze_vision_tower freeze_multi_modal_projector freeze_language_model
compute_accuracy disable_shuffling early_stopping_steps plot_loss include_effective_tokens_per_second
ray_num_workers ray_init_kwargs master_addr master_port overwrite_output_dir
""".split()
)
# Its TrainingArguments is transformers' Seq2SeqTrainingArguments (pinned <=5.8.0): the fields of it emitted
# (each in every transformers from 4.34 on, train_sampling_strategy from its 2026 train-sampler unification;
# checked against the installed one below).
LLAMAFACTORY_TRAINING_ARGUMENTS = frozenset(
    """
per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps bf16 fp16 tf32 optim optim_args
torch_compile prediction_loss_only eval_accumulation_steps ddp_find_unused_parameters use_cpu train_sampling_strategy
""".split()
)
LLAMAFACTORY_ATTENTIONS = {"auto", "disabled", "sdpa", "fa2", "fa3"}  # extras/constants.py, AttentionFunction


def best_of(config: ProbeConfig, device_type: str = "cuda") -> BestConfig:
    return BestConfig(dataclasses.replace(leaderboard_row(config), study="s"), device_type)


WINNERS = {
    "bf16-ckpt-sdpa": ProbeConfig("gpt2", 4, 64, grad_accum=2, precision="bf16", checkpointing=True, attention="sdpa"),
    "fp32-accumulating": ProbeConfig("gpt2", 2, 32, grad_accum=2, precision="fp32"),
    "lora": ProbeConfig(
        "gpt2", 4, 64, precision="bf16", peft=peft_text("lora", rank=16, alpha=32, targets="c_attn,c_proj")
    ),
    "qlora": ProbeConfig("gpt2", 4, 64, precision="bf16", peft=peft_text("qlora")),
    "eval-batch": ProbeConfig("gpt2", 2, 64, precision="fp16", eval_batch=8, optimizer="sgd", attention="eager"),
    "pure-bf16-tf32-free": ProbeConfig(
        "gpt2", 2, 64, precision="fp32", weights="bf16", attention="flex_attention", compile=True, liger=True
    ),
    "fsdp": ProbeConfig("gpt2", 2, 64, precision="bf16", checkpointing=True, gpus=4, strategy="fsdp"),
    "ddp": ProbeConfig("gpt2", 2, 64, precision="tf32", gpus=2, strategy="ddp", optimizer="adafactor"),
}


@pytest.fixture(params=sorted(WINNERS))
def winner(request) -> BestConfig:
    return best_of(WINNERS[request.param])


def test_every_tool_format_is_one_of_best_formats():
    from autotune.cli.results import BEST_FORMATS

    assert set(tools.TOOL_FORMATS) <= set(BEST_FORMATS)


# --- axolotl ---------------------------------------------------------------------------------------


def test_axolotl_emits_only_its_fields_with_values_they_accept(winner):
    from transformers.training_args import OptimizerNames

    doc = tools.axolotl_document(winner)
    c = winner.config
    assert set(doc) <= AXOLOTL_FIELDS and set(tools.AXOLOTL.values()) <= AXOLOTL_FIELDS
    assert doc["micro_batch_size"] == c.micro_batch and doc["gradient_accumulation_steps"] == c.grad_accum
    assert doc["sequence_len"] == c.block_size and doc["pad_to_sequence_len"] is True
    # bf16 and tf32 default to "auto" in axolotl: always said, one of them at most on
    assert {doc["bf16"], doc["fp16"], doc["tf32"]} <= {True, False} and doc["bf16"] + doc["fp16"] + doc["tf32"] <= 1
    assert doc["bf16"] == (c.precision == "bf16") and doc["tf32"] == (c.precision == "tf32")
    assert doc["gradient_checkpointing"] is c.checkpointing
    assert doc.get("gradient_checkpointing_kwargs") == ({"use_reentrant": False} if c.checkpointing else None)
    assert doc["attn_implementation"] in AXOLOTL_ATTENTIONS and doc["attn_implementation"] == c.attention
    assert doc["optimizer"] in {o.value for o in OptimizerNames}
    if c.peft is None:
        assert "adapter" not in doc and not {k for k in doc if k.startswith("lora_")}
    else:
        assert doc["adapter"] in {"lora", "qlora"} and isinstance(doc["lora_r"], int)
        assert (doc["adapter"] == "qlora") == doc.get("load_in_4bit", False)
        assert doc.get("lora_target_linear") is True or all(isinstance(t, str) for t in doc["lora_target_modules"])
    if "fsdp_config" in doc:
        assert set(doc["fsdp_config"]) <= AXOLOTL_FSDP_FIELDS and doc["fsdp_version"] == 2
        assert doc["fsdp_config"]["auto_wrap_policy"] in {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"}
        assert doc["fsdp_config"]["state_dict_type"] in {"FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"}
        assert isinstance(doc["fsdp_config"]["transformer_layer_cls_to_wrap"], str)  # (a str in axolotl's schema)


def test_axolotl_says_each_lever_of_these_winners_exactly():
    lora = tools.axolotl_document(best_of(WINNERS["lora"]))
    assert (lora["adapter"], lora["lora_r"], lora["lora_alpha"], lora["lora_dropout"], lora["lora_target_modules"]) == (
        "lora",
        16,
        32,
        0.05,
        ["c_attn", "c_proj"],
    )
    qlora = tools.axolotl_document(best_of(WINNERS["qlora"]))
    assert qlora["adapter"] == "qlora" and qlora["load_in_4bit"] is True and qlora["lora_target_linear"] is True
    assert tools.axolotl_document(best_of(WINNERS["eval-batch"]))["eval_batch_size"] == 8
    pure = tools.axolotl_document(best_of(WINNERS["pure-bf16-tf32-free"]))
    assert pure["bfloat16"] is True and pure["bf16"] is False and pure["torch_compile"] is True
    assert pure["plugins"] == ["axolotl.integrations.liger.LigerPlugin"] and pure["liger_fused_linear_cross_entropy"]
    assert tools.axolotl_document(best_of(WINNERS["ddp"]))["ddp_find_unused_parameters"] is False


# --- LLaMA-Factory ---------------------------------------------------------------------------------


def test_llamafactory_emits_only_its_fields_with_values_they_accept(winner):
    from transformers import Seq2SeqTrainingArguments
    from transformers.training_args import OptimizerNames

    assert LLAMAFACTORY_TRAINING_ARGUMENTS <= {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    fields = LLAMAFACTORY_FIELDS | LLAMAFACTORY_TRAINING_ARGUMENTS
    doc = tools.llamafactory_document(winner)
    c = winner.config
    assert set(doc) <= fields and set(tools.LLAMAFACTORY.values()) <= fields
    assert doc["per_device_train_batch_size"] == c.micro_batch and doc["cutoff_len"] == c.block_size
    # LLaMA-Factory turns checkpointing ON by default: always said
    assert doc["disable_gradient_checkpointing"] is (not c.checkpointing)
    assert doc.get("use_reentrant_gc", True) is (not c.checkpointing)
    assert doc.get("flash_attn", "auto") in LLAMAFACTORY_ATTENTIONS
    assert doc["finetuning_type"] in {"lora", "oft", "freeze", "full"}
    assert doc["optim"] in {o.value for o in OptimizerNames}
    assert doc.get("pure_bf16", False) is (c.weights == "bf16")
    if "quantization_bit" in doc:
        assert doc["quantization_bit"] in {4, 8} and doc["quantization_type"] in {"fp4", "nf4"}
        assert doc["quantization_method"] == "bnb" and doc["finetuning_type"] == "lora"


def test_llamafactory_says_each_lever_of_these_winners_exactly():
    ckpt = tools.llamafactory_document(best_of(WINNERS["bf16-ckpt-sdpa"]))
    assert (ckpt["bf16"], ckpt["flash_attn"], ckpt["disable_gradient_checkpointing"]) == (True, "sdpa", False)
    fp32 = tools.llamafactory_document(best_of(WINNERS["fp32-accumulating"]))
    assert fp32["disable_gradient_checkpointing"] is True and fp32["gradient_accumulation_steps"] == 2
    lora = tools.llamafactory_document(best_of(WINNERS["lora"]))
    assert (lora["finetuning_type"], lora["lora_rank"], lora["lora_alpha"], lora["lora_target"]) == (
        "lora",
        16,
        32,
        "c_attn,c_proj",
    )
    qlora = tools.llamafactory_document(best_of(WINNERS["qlora"]))
    assert qlora["quantization_bit"] == 4 and qlora["lora_target"] == "all" and qlora["double_quantization"] is True
    evaluating = tools.llamafactory_document(best_of(WINNERS["eval-batch"]))
    assert evaluating["per_device_eval_batch_size"] == 8 and evaluating["prediction_loss_only"] is True
    assert evaluating["flash_attn"] == "disabled" and evaluating["optim_args"] == "momentum=0.9"
    flex = best_of(WINNERS["pure-bf16-tf32-free"])
    assert "flash_attn" not in tools.llamafactory_document(flex)
    assert any("flex_attention" in line for line in tools.notes(flex, "llamafactory"))  # said, not dropped


# --- every format: parsed back, nothing dropped -----------------------------------------------------


@pytest.mark.parametrize("fmt", ["axolotl", "llamafactory", "lightning"])
def test_yaml_reads_back_as_the_document(winner, fmt):
    import yaml

    text = tools.render_tool(winner, fmt)
    document = getattr(tools, f"{fmt}_document")(winner)
    assert yaml.safe_load(text) == json.loads(json.dumps(document))
    comments = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert comments[1:] == tools.notes(winner, fmt)


def test_trl_json_holds_sft_config_peft_config_and_notes(winner):
    out = json.loads(tools.render_tool(winner, "trl"))
    assert out["sft_config"] == json.loads(json.dumps(tools.trl_document(winner)))
    assert out["notes"] == tools.notes(winner, "trl")
    assert out.get("peft_config") == winner.lora_kwargs()


def test_what_a_tool_cannot_say_is_said_by_hand():
    pure = best_of(WINNERS["pure-bf16-tf32-free"])
    lightning = tools.notes(pure, "lightning")
    assert any("torch.compile" in line for line in lightning) and any("Liger" in line for line in lightning)
    assert any("tf32" in line for line in tools.notes(best_of(WINNERS["ddp"]), "lightning"))
    assert any("FSDP2" in line and "GPT2Block" in line for line in tools.notes(best_of(WINNERS["fsdp"]), "lightning"))
    assert any("--num_processes 4" in line for line in tools.notes(best_of(WINNERS["fsdp"]), "axolotl"))
    assert any("accelerate_config.yaml" in line for line in tools.notes(best_of(WINNERS["fsdp"]), "llamafactory"))
    assert any("loss-only" in line for line in tools.notes(best_of(WINNERS["eval-batch"]), "axolotl"))
    assert any("fp32 master weights" in line for line in tools.notes(best_of(WINNERS["bf16-ckpt-sdpa"]), "axolotl"))
    allocator = best_of(dataclasses.replace(WINNERS["fp32-accumulating"], allocator="expandable"))
    assert all(any("PYTORCH_" in line for line in tools.notes(allocator, fmt)) for fmt in tools.TOOL_FORMATS)


def test_tools_for_causal_lms_refuse_another_task():
    classifier = best_of(ProbeConfig("bert", 2, 64, task="classification", num_labels=3))
    for fmt in ("trl", "axolotl", "llamafactory"):
        with pytest.raises(BadInput, match="causal language models"):
            tools.render_tool(classifier, fmt)
    assert tools.lightning_document(classifier)["data"]["batch_size"] == 2


def test_docs_table_names_every_key():
    text = (Path(__file__).parent.parent / "docs" / "tools.md").read_text()
    for table in (tools.TRL, tools.AXOLOTL, tools.LLAMAFACTORY, tools.LIGHTNING):
        for key in table.values():
            assert f"`{key}`" in text, key


# --- TRL: SFTConfig takes the document, SFTTrainer trains with it ----------------------------------


def test_trl_sft_config_takes_the_document(winner, tmp_path):
    trl = pytest.importorskip("trl")
    doc = tools.trl_document(winner)
    fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    assert set(doc) <= fields and "max_seq_length" not in doc
    assert {v for k, v in tools.TRL.items() if k not in ("lora", "checkpointing")} <= fields
    if winner.config.precision == "bf16":  # (TrainingArguments refuses bf16 without a device that has it)
        doc = {**doc, "use_cpu": True}
    if doc["tf32"]:  # (and tf32 without an Ampere GPU: the key is checked above)
        doc = {**doc, "tf32": False}
    args = trl.SFTConfig(output_dir=str(tmp_path), **doc)
    c = winner.config
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_length) == (
        c.micro_batch,
        c.grad_accum,
        c.block_size,
    )
    assert args.gradient_checkpointing is c.checkpointing  # SFTConfig's default (on) does not win
    assert (args.bf16, args.fp16) == (c.precision == "bf16", c.precision == "fp16")
    assert args.packing is True and args.packing_strategy == "wrapped" and not args.padding_free
    assert args.model_init_kwargs["attn_implementation"] == c.attention


def _tiny_gpt2(directory: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from tests.helpers.corpus import corpus_text

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [corpus_text()[:200_000]],
        vocab_size=1000,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _texts(n: int = 64) -> list[str]:
    from tests.helpers.corpus import corpus_text

    paragraphs = [p for p in corpus_text().split("\n\n") if len(p) > 200]
    return paragraphs[:n]


@pytest.mark.slow
def test_sft_trainer_trains_three_steps_with_the_document(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    best = best_of(WINNERS["fp32-accumulating"], device_type="cpu")
    model_dir = _tiny_gpt2(tmp_path / "model")
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        **tools.trl_document(best),
    )
    seen: list[tuple[int, int]] = []
    trainer = trl.SFTTrainer(model=str(model_dir), args=args, train_dataset=Dataset.from_dict({"text": _texts()}))
    trainer.model.register_forward_pre_hook(
        lambda module, inputs, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    trainer.train()
    assert trainer.state.global_step == 3
    assert seen == [(2, 32)] * 6  # micro-batch 2 of full 32-token blocks, 2 per step
    checkpointing = getattr(trainer.model, "is_activation_checkpointing", None)
    assert trainer.model.config._attn_implementation == "sdpa" and checkpointing is False  # SFTConfig's default is on
    assert str(next(trainer.model.parameters()).dtype) == "torch.float32"  # model_init_kwargs' dtype


# --- Lightning: Trainer takes `trainer`, a LightningModule and DataModule take `model` and `data` ----------


def _lightning_classes():
    import lightning as L
    import torch

    class TinyData(L.LightningDataModule):
        def __init__(self, directory: str, batch_size: int, block_size: int, eval_batch_size: int | None = None):
            super().__init__()
            self.directory, self.batch_size, self.block_size = directory, batch_size, block_size

        def train_dataloader(self):
            from transformers import AutoTokenizer

            ids = AutoTokenizer.from_pretrained(self.directory)("\n\n".join(_texts()))["input_ids"]
            blocks = torch.tensor(ids[: len(ids) // self.block_size * self.block_size]).view(-1, self.block_size)
            return torch.utils.data.DataLoader(blocks, batch_size=self.batch_size, drop_last=True)

    class TinyCausalLM(L.LightningModule):
        def __init__(
            self,
            directory: str,
            attn_implementation: str,
            gradient_checkpointing: bool,
            optimizer: dict,
            lora_config: dict | None = None,
        ):
            super().__init__()
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(
                directory, attn_implementation=attn_implementation, use_cache=False
            ).train()
            if gradient_checkpointing:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.optimizer, self.shapes = optimizer, []

        def training_step(self, batch, batch_idx):
            self.shapes.append(tuple(batch.shape))
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):  # LightningCLI's `optimizer:` section, instantiated as the CLI does
            import importlib

            module, name = self.optimizer["class_path"].rsplit(".", 1)
            return getattr(importlib.import_module(module), name)(
                self.parameters(), lr=1e-3, **self.optimizer.get("init_args", {})
            )

    return TinyData, TinyCausalLM


@pytest.mark.parametrize("name", sorted(WINNERS))
def test_lightning_trainer_takes_the_trainer_section(name):
    pytest.importorskip("lightning")
    import lightning as L

    doc = tools.lightning_document(best_of(WINNERS[name]))
    trainer_args = {**doc["trainer"], "accelerator": "cpu"}
    strategy = trainer_args.pop("strategy", None)
    if isinstance(strategy, dict):  # LightningCLI instantiates class_path(**init_args)
        from lightning.pytorch.strategies import FSDPStrategy

        assert strategy["class_path"] == "lightning.pytorch.strategies.FSDPStrategy"
        FSDPStrategy(**strategy["init_args"])
    elif strategy is not None:
        assert strategy == "ddp"
    trainer_args["devices"] = 1  # (a CPU here: the processes are checked above)
    trainer_args["num_nodes"] = 1
    if trainer_args["precision"] == "16-mixed":
        trainer_args["precision"] = "bf16-mixed"  # (16-mixed needs CUDA; the value is one Lightning names)
    trainer = L.Trainer(**trainer_args, max_steps=1, logger=False, enable_checkpointing=False)
    assert trainer.accumulate_grad_batches == WINNERS[name].grad_accum
    assert doc["trainer"]["precision"] in {"32-true", "bf16-mixed", "16-mixed", "bf16-true"}


@pytest.mark.slow
def test_lightning_trains_three_steps_with_the_document(tmp_path):
    pytest.importorskip("lightning")
    import lightning as L

    best = best_of(WINNERS["fp32-accumulating"], device_type="cpu")
    doc = tools.lightning_document(best)
    assert doc["trainer"]["accelerator"] == "cpu" and doc["trainer"]["precision"] == "32-true"
    directory = str(_tiny_gpt2(tmp_path / "model"))
    TinyData, TinyCausalLM = _lightning_classes()
    model = TinyCausalLM(directory, optimizer=doc["optimizer"], **doc["model"])
    trainer = L.Trainer(
        **doc["trainer"],
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=TinyData(directory, **doc["data"]))
    assert trainer.global_step == 3
    assert model.shapes == [(2, 32)] * 6  # 3 optimizer steps of 2 accumulated micro-batches of 2 x 32 tokens
