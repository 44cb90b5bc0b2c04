"""QLoRA (--peft qlora): the base's linear layers in 4 bits through bitsandbytes, LoRA adapters on it.

autotune refuses QLoRA off CUDA (`check_recipe`): a CPU measurement of it tells no card anything.
But bitsandbytes quantizes to 4 bits on CPU too, so these tests lift that refusal in this process
and run the probe's own build and steps for real on CPU: the estimate (which predicts a 7B QLoRA
for a 24 GiB card, tests/estimate) is checked against a real 4-bit run to the byte here, and the
model `autotune train` builds is the probe's."""

from __future__ import annotations

import importlib.util
import json

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.levers.recipes import bnb_4bit_kwargs, peft_text

# (find_spec, not importorskip: importing peft and bitsandbytes to collect this module costs every
# test worker seconds)
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("bitsandbytes", "peft")),
    reason="needs bitsandbytes and peft (pip install 'autotune[peft]' bitsandbytes)",
)

GiB = 2**30
QLORA = peft_text("qlora")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.helpers.models import write_model_dir

    return str(
        write_model_dir(
            tmp_path_factory.mktemp("qlora") / "tiny-gpt2",
            n_embd=128,
            n_head=4,
            vocab_size=1000,
            n_positions=512,
            n_ctx=512,
        )
    )


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> str:
    from tests.helpers.tiny_tasks import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("qlora-classifier"), "bert-classification"))


def cfg(model: str, **levers) -> ProbeConfig:
    return ProbeConfig(model=model, **{"micro_batch": 4, "block_size": 128, **levers})


def probe_on_cpu(config: ProbeConfig, monkeypatch):
    """The probe child's own run, in this process, with the CUDA-only rule lifted."""
    from autotune.specs.models import resolve_model
    from autotune.probe import child
    from autotune.probe.protocol import ProbeRequest

    from autotune.results.budget import Budget
    from autotune.probe.settings import ProbeSettings

    monkeypatch.setattr(child, "check_recipe", lambda config, device: None)
    return child.run_probe_in_process(
        ProbeRequest(
            config=config,
            model=resolve_model(config.model),
            budget=Budget(4 * GiB, 0),
            settings=ProbeSettings(device="cpu", warmup_steps=2, measure_steps=1),
        )
    )


@pytest.mark.slow
def test_a_4bit_base_on_cpu_matches_its_estimate_to_the_byte_and_needs_less_than_lora(
    model_dir, classifier_dir, monkeypatch, trace_children
):
    from autotune.estimate import estimate_memories

    cases = [
        {"peft": QLORA},
        {"peft": QLORA, "precision": "bf16", "weights": "bf16", "checkpointing": True},
        {"peft": peft_text("lora")},
    ]
    configs = [cfg(model_dir, **case) for case in cases]
    # A model of another task: a BERT classifier, whose head trains whole and so stays unquantized.
    configs.append(cfg(classifier_dir, peft=QLORA, task="classification", num_labels=3))
    measured = [probe_on_cpu(config, monkeypatch) for config in configs]
    predicted = estimate_memories(configs, device_type="cpu", use_cache=False, children=trace_children)
    for config, probe, estimate in zip(configs, measured, predicted):
        assert probe.status == "ok", probe.error
        assert (estimate.peak_bytes, estimate.reserved_bytes) == (
            probe.peak_allocated_bytes,
            probe.peak_reserved_bytes,
        ), config.label()
    qlora, _, lora, _ = measured
    assert qlora.peak_allocated_bytes < lora.peak_allocated_bytes
    # The same adapters train on the same model: only the base's bytes differ. Parameters count
    # the values a 4-bit weight holds, not its packed bytes.
    assert qlora.trainable_parameters == lora.trainable_parameters and qlora.parameters == lora.parameters
    assert predicted[0].params < predicted[2].params / 1.5
    assert 0 < qlora.last_loss < 20  # an ordinary, finite loss


@pytest.mark.slow
def test_the_trace_copies_a_classifiers_fake_head_without_its_data_pointer_or_fake_mode(classifier_dir, monkeypatch):
    """peft deep-copies the head a classifier trains whole. torch's own deep copy of a fake tensor
    reads its data pointer and copies its FakeTensorMode, whose StorageWeakRef copies free a
    storage twice: the trace child aborted ("corrupted double-linked list") one run in four."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from autotune.estimate.protocol import TraceItem
    from autotune.estimate.trace import trace
    from autotune.specs.models import resolve_model

    def refuse(what):
        def refused(*args, **kwargs):
            raise AssertionError(f"the trace {what}")

        return refused

    monkeypatch.setattr(FakeTensor, "data_ptr", refuse("read a fake tensor's data pointer"), raising=False)
    monkeypatch.setattr(FakeTensorMode, "__deepcopy__", refuse("deep-copied its FakeTensorMode"), raising=False)
    spec = resolve_model(classifier_dir)
    config = cfg(classifier_dir, micro_batch=2, block_size=32, peft=QLORA, task="classification", num_labels=3)
    result = trace(TraceItem(config=config, model_config=spec.config, model_path=spec.path), "cpu")
    assert result.peak_bytes > 0


def test_train_builds_the_probes_4bit_base_and_its_adapters_save_and_load(model_dir, tmp_path):
    import bitsandbytes as bnb
    import torch
    from peft import PeftModel

    from autotune.specs.models import resolve_model
    from autotune.probe.step import ProbeStep, make_optimizer, parameter_count
    from autotune.train.loading import build_model

    config = cfg(model_dir, micro_batch=2, block_size=32, precision="bf16", peft=peft_text("qlora", rank=4))
    model = build_model(resolve_model(model_dir), config, torch.device("cpu"), weights=None)
    base = model.get_base_model()
    four_bit = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * 4  # per block: attention in and out, MLP in and out (GPT-2's Conv1D layers)
    assert all(m.weight.dtype == torch.uint8 and m.compute_dtype == torch.bfloat16 for m in four_bit)
    assert base.lm_head.weight.dtype == torch.float32  # kept whole, as transformers' quantizer keeps it
    assert base.lm_head.weight is base.transformer.wte.weight  # and still tied
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    step = ProbeStep(model, make_optimizer(model, torch.device("cpu")), config, torch.device("cpu"), 1000)
    losses = [step() for _ in range(2)]
    assert all(0 < loss < 20 for loss in losses)
    assert any(not torch.equal(p, trained[name]) for name, p in model.named_parameters() if p.requires_grad)

    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["peft_type"] == "LORA"
    from transformers import AutoModelForCausalLM

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_config(base.config), tmp_path / "adapter")
    assert parameter_count(reloaded, trainable=False) == parameter_count(model)


def test_qlora_is_refused_off_cuda_and_without_bitsandbytes_in_one_line(monkeypatch):
    import torch

    from autotune.estimate.predict import check_traceable
    from autotune.specs.models import resolve_model
    from autotune.probe.step import check_recipe

    config = cfg("gpt2", peft=QLORA)
    with pytest.raises(BadInput, match="it needs a CUDA device"):
        check_recipe(config, torch.device("cpu"))
    check_traceable(config, "cuda", resolve_model("gpt2"))  # the estimator predicts it for a card
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(BadInput, match="--peft qlora needs bitsandbytes"):
        check_recipe(config, torch.device("cuda"))
    with pytest.raises(BadInput, match="--peft qlora needs bitsandbytes to be traced"):
        check_traceable(config, "cuda", resolve_model("gpt2"))


def test_the_hand_off_loads_the_base_in_4_bits():
    from autotune.handoff import BestConfig
    from tests.helpers.store import leaderboard_row

    best = BestConfig(leaderboard_row(cfg("gpt2", precision="bf16", peft=QLORA)), "cuda")
    kwargs = best.model_kwargs()
    assert kwargs["quantization_config"] == bnb_4bit_kwargs("bf16") and kwargs["dtype"] == "float32"
    quantization = best.quantization_config()
    assert type(quantization).__name__ == "BitsAndBytesConfig" and quantization.load_in_4bit
    assert quantization.bnb_4bit_quant_type == "nf4" and quantization.bnb_4bit_use_double_quant
    assert str(quantization.bnb_4bit_compute_dtype) == "torch.bfloat16"
    assert best.lora_config().r == 8
    document = best.trainer_args_document()
    assert document["model_kwargs"]["quantization_config"]["load_in_4bit"] is True
    assert any(line.startswith("4-bit base:") for line in best.cli_caveats())
    assert (
        "quantization_config"
        not in BestConfig(leaderboard_row(cfg("gpt2", peft=peft_text("lora"))), "cuda").model_kwargs()
    )


def test_a_classifiers_head_stays_whole_and_trains_on_a_4bit_base(classifier_dir):
    import bitsandbytes as bnb
    import torch

    from autotune.specs.models import resolve_model
    from autotune.probe.step import build_random_model

    config = cfg(classifier_dir, micro_batch=2, block_size=32, peft=QLORA, task="classification", num_labels=3)
    model, _ = build_random_model(resolve_model(classifier_dir), config, torch.device("cpu"), False)
    head = model.get_base_model().classifier
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in head.modules())
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())  # the encoder's layers are 4-bit
    assert all(p.requires_grad for p in head.modules_to_save.parameters())  # peft trains the head whole
    from autotune.handoff import BestConfig
    from tests.helpers.store import leaderboard_row

    assert BestConfig(leaderboard_row(config), "cuda").model_kwargs()["quantization_config"][
        "llm_int8_skip_modules"
    ] == ["classifier", "score"]
