"""Predicting a run on an older stack (estimate/stack.py, estimate/older_stacks.py), and torch's
default AdamW: what each changes in a traced step, on a tiny model, through the real trace child."""

from __future__ import annotations

import importlib.util

import pytest

from autotune.levers.config import ProbeConfig
from autotune.estimate import estimate_memories
from autotune.vocabulary.errors import BadInput
from autotune.estimate.stack import Stack
from autotune.levers.recipes import peft_text
from tests.helpers.models import write_model_dir

LAYERS, HEADS, BATCH, BLOCK = 2, 4, 2, 128


@pytest.mark.parametrize(
    "stack, softmax, grads, four_bit",
    [
        (Stack(), False, False, False),
        (Stack(torch="1.10.2"), True, True, False),  # before 1.11: both
        (Stack(torch="1.13.1"), False, True, False),  # before 2.0: zeroed gradients kept
        (Stack(torch="2.4.1", bitsandbytes="0.41.1"), False, False, True),
        (Stack(bitsandbytes="0.43.2"), False, False, False),  # the release that fixed it
        (Stack(torch="nightly"), False, False, False),  # not a version: the installed behaviour
    ],
)
def test_each_behaviour_belongs_to_the_versions_before_its_change(stack, softmax, grads, four_bit):
    assert (stack.keeps_softmax_inputs, stack.keeps_zeroed_grads, stack.keeps_4bit_inputs) == (softmax, grads, four_bit)
    assert len(stack.differences()) == softmax + grads + four_bit
    assert Stack.from_dict(stack.to_dict()) == stack


def test_a_stack_is_read_from_library_version_pairs():
    assert Stack.parse("torch=1.13, bitsandbytes=0.41.1") == Stack(torch="1.13", bitsandbytes="0.41.1")
    assert Stack.parse("Torch=2.4") == Stack(torch="2.4")
    assert Stack.parse(None) == Stack.parse("") == Stack()
    for bad in ("torch", "jax=0.4", "torch=new", "torch=1.13;bitsandbytes=0.41"):
        with pytest.raises(BadInput, match="--stack"):
            Stack.parse(bad)


QLORA_TRACEABLE = importlib.util.find_spec("bitsandbytes") is not None and importlib.util.find_spec("peft") is not None


@pytest.fixture(scope="module")
def estimates(tmp_path_factory, trace_children):
    """Tiny GPT-2 (eager attention, so that softmax's input is the S x S scores) estimated for a
    CUDA run on the installed stack, on torch 1.10, and on torch 1.13 with bitsandbytes 0.41.1;
    its AdamW variants; and its QLoRA on the installed and the older bitsandbytes. One trace child
    for the three stacks (each trace enters its stack's emulations and leaves them)."""
    model = str(
        write_model_dir(
            tmp_path_factory.mktemp("stack") / "tiny-gpt2",
            n_layer=LAYERS,
            n_embd=128,
            n_head=HEADS,
            vocab_size=1000,
            n_positions=512,
            n_ctx=512,
        )
    )
    plain = ProbeConfig(model=model, micro_batch=BATCH, block_size=BLOCK, attention="eager")
    small = ProbeConfig(model=model, micro_batch=1, block_size=16)  # the optimizer step is the peak
    qlora = (
        [ProbeConfig(model=model, micro_batch=BATCH, block_size=BLOCK, precision="bf16", peft=peft_text("qlora"))]
        if QLORA_TRACEABLE
        else []
    )
    out: dict = {}
    out["now"], out["fused"], out["foreach"], *now_qlora = estimate_memories(
        [plain, small, ProbeConfig(**{**small.to_dict(), "optimizer": "adamw_torch"}), *qlora],
        use_cache=False,
        children=trace_children,
    )
    (out["torch-1.10"],) = estimate_memories(
        [plain], stack=Stack(torch="1.10"), use_cache=False, children=trace_children
    )
    out["torch-1.13"], *older_qlora = estimate_memories(
        [plain, *qlora], stack=Stack(torch="1.13", bitsandbytes="0.41.1"), use_cache=False, children=trace_children
    )
    out["qlora"] = (now_qlora[0], older_qlora[0]) if qlora else None
    return out


@pytest.mark.slow
def test_torch_before_2_keeps_the_zeroed_gradients_through_the_next_step(estimates):
    now, kept = estimates["now"], estimates["torch-1.13"]
    assert now.grads < now.params  # freed after each step: the backward peak holds a few
    assert kept.grads == kept.params  # fp32 full fine-tune: gradients as large as the weights
    assert kept.peak_bytes >= now.peak_bytes + (kept.params - now.grads) - 2**20
    assert "torch 1.13: gradients zeroed in place" in " ".join(kept.notes)


@pytest.mark.slow
def test_torch_before_1_11_keeps_every_softmax_input_until_backward(estimates):
    scores = LAYERS * BATCH * HEADS * BLOCK * BLOCK * 4  # fp32 attention scores, one per layer
    older, newer = estimates["torch-1.10"], estimates["torch-1.13"]
    assert older.activations - newer.activations >= scores


@pytest.mark.slow
def test_torchs_default_adamw_allocates_temporaries_the_fused_one_does_not(estimates):
    fused, foreach = estimates["fused"], estimates["foreach"]
    assert foreach.config.optimizer == "adamw_torch" and foreach.peak_phase == "optimizer step"
    assert foreach.temporaries >= foreach.params  # the step's sqrt of the second moments, all at once
    assert foreach.peak_bytes > fused.peak_bytes
    assert fused.peak_phase != "optimizer step" or fused.temporaries < fused.params / 2


@pytest.mark.slow
@pytest.mark.skipif(not QLORA_TRACEABLE, reason="QLoRA's trace needs bitsandbytes and peft")
def test_bitsandbytes_before_0_43_2_keeps_each_4bit_layers_input(estimates):
    now, older = estimates["qlora"]
    # Each block's 4-bit layers: the attention's output projection and the MLP's two take inputs
    # that nothing else keeps (the fused qkv projection shares its input with LoRA's). (The frozen
    # base has no gradients to keep: torch 1.13's rule changes only the adapters'.)
    assert older.activations > now.activations
    assert "bitsandbytes 0.41.1: each 4-bit layer keeps its input" in " ".join(older.notes)
