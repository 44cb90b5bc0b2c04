"""The estimator's tracing, in this process: CUDA emulation, the autocast lists, and the ledger
against torch's own MemTracker. (The API and CLI tests go through the child process.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from autotune.levers.config import ProbeConfig  # noqa: E402
from autotune.estimate import cuda as emulation  # noqa: E402
from autotune.estimate.protocol import TraceItem, TraceResult  # noqa: E402
from autotune.estimate.ledger import Ledger, replay  # noqa: E402
from autotune.estimate.trace import trace  # noqa: E402
from tests.helpers.models import TINY_GPT2  # noqa: E402

# Each test traces real training steps on fake tensors in this process (torch and transformers).
pytestmark = pytest.mark.slow


def run_trace(device_type: str, **levers) -> TraceResult:
    config = ProbeConfig(model="tiny", **{"micro_batch": 2, "block_size": 128, **levers})
    return trace(TraceItem(config=config, model_config=TINY_GPT2, model_path=None), device_type)


def test_cuda_emulation_picks_cuda_kernels():
    fp32 = run_trace("cuda", precision="fp32")
    bf16 = run_trace("cuda", precision="bf16")
    eager = run_trace("cuda", precision="fp32", attention="eager")
    # One traced step (the second repeats its events) x 2 layers: SDPA's memory-efficient kernel in
    # fp32, flash in bf16; dropout fused (embeddings once, then the attention output and the MLP
    # output of each layer)
    assert fp32.kernels == {"mem_efficient": 2, "native_dropout": 1 + 2 * 2}
    assert bf16.kernels["flash"] == 2 and "mem_efficient" not in bf16.kernels
    assert "flash" not in eager.kernels and "mem_efficient" not in eager.kernels
    assert eager.kernels["native_dropout"] == 1 + 2 * 3  # the attention weights' dropout too


def test_a_trace_in_this_process_leaves_transformers_masks_and_the_batches_as_it_found_them():
    # The trace answers transformers' mask questions as a real run of the probe's batches would
    # (trace._real_run_mask_rules). Those answers once stayed installed in the process: a padding-free
    # batch's real forward afterwards in the same process lost its packing and attended across its
    # examples (tests/train/test_padding_free.py failed when it ran after this module on one worker).
    import transformers
    import transformers.masking_utils as masking

    from autotune.probe import batches
    from autotune.probe.batches import keeps_examples_apart

    before = {name: getattr(masking, name, None) for name in dir(masking) if not name.startswith("__")}
    made = (batches.padding_mask, batches.flattened)
    from tests.helpers.lengths import BLOCK, TEXT

    run_trace("cuda", precision="bf16", block_size=BLOCK, padding_free=True, lengths=TEXT, grad_accum=2)
    assert {name: getattr(masking, name, None) for name in before} == before
    assert (batches.padding_mask, batches.flattened) == made
    torch.manual_seed(0)
    hf = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=64, use_cache=False)
    assert keeps_examples_apart(transformers.GPT2LMHeadModel(hf), 96, torch.device("cpu"))


def test_trls_tiles_fold_in_place_on_cuda_as_its_triton_kernels_do():
    """--trainer trl on a card: TRL's Triton kernels fold each tile of logits in place, where the
    torch fold a CPU trace would run makes tile-sized fp32 temporaries (estimate/cuda.py, 4). With a
    vocabulary of 50,257 the fused head holds less than Trainer's full logits."""
    pytest.importorskip("trl")
    config = {**TINY_GPT2, "vocab_size": 50257}

    def traced(device_type: str, trainer: str) -> TraceResult:
        levers = ProbeConfig(model="tiny", micro_batch=2, block_size=128, precision="bf16", trainer=trainer)
        return trace(TraceItem(config=levers, model_config=config, model_path=None), device_type)

    trl, plain, trl_cpu = traced("cuda", "trl"), traced("cuda", "transformers"), traced("cpu", "trl")
    # One traced step (the second is its copy): 50,257 columns in two tiles of up to 32,768, each
    # folded forward and backward, each backward tile accumulating two products (hidden, weight).
    assert {k: v for k, v in trl.kernels.items() if k.startswith("trl")} == {
        "trl_forward_tile": 2,
        "trl_backward_tile": 2,
        "trl_addmm_fp32": 4,
    }
    assert not any(k.startswith("trl") for k in plain.kernels)
    assert trl.peak_bytes < plain.peak_bytes
    # The CPU fold's temporaries, which the card's kernels do not make: at least two fp32 tiles of
    # 254 tokens x 32,768 columns.
    assert trl_cpu.peak_bytes - trl.peak_bytes > 2 * 254 * 32768 * 4


@pytest.mark.parametrize(
    "device_type, levers",
    [
        ("cpu", {"precision": "fp32"}),
        ("cuda", {"precision": "fp32"}),
        ("cuda", {"precision": "bf16", "checkpointing": True, "grad_accum": 2}),
        ("cpu", {"precision": "fp16", "grad_accum": 3}),  # GradScaler: its scale is made once
        ("cuda", {"precision": "fp16", "attention": "eager", "eval_batch": 4}),
        ("cuda", {"peft": "lora r=8 alpha=16 dropout=0.05 targets=all-linear", "checkpointing": True}),
        ("cpu", {"optimizer": "adamw", "grad_accum": 2}),
        ("cuda", {"optimizer": "sgd", "weights": "bf16", "precision": "bf16"}),
        ("cuda", {"trainer": "trl", "precision": "bf16", "grad_accum": 2}),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(f"{k}={x}" for k, x in v.items()),
)
def test_the_second_step_copied_from_the_first_equals_the_second_step_traced(monkeypatch, device_type, levers):
    """What makes a trace half as long (trace.REPEAT_FIRST_STEP): every replayed figure of the
    copy, the peaks by phase, the breakdown at the peak, reserved memory and the event count, equals
    the trace of both steps."""
    from dataclasses import asdict

    from autotune.estimate import trace as tracing

    copied = []
    repeat = Ledger.repeat_events_from
    monkeypatch.setattr(
        Ledger, "repeat_events_from", lambda self, start: copied.append(repeat(self, start)) or copied[-1]
    )
    once = run_trace(device_type, **levers)
    assert copied == [True], "the second step was traced, not copied"
    monkeypatch.setattr(tracing, "REPEAT_FIRST_STEP", False)
    twice = run_trace(device_type, **levers)
    figures = lambda r: {
        k: v
        for k, v in asdict(r).items()
        if k
        not in (
            "build_seconds",
            "trace_seconds",
            "replay_seconds",
            "kernels",
        )
    }
    assert figures(once) == figures(twice)


def test_a_step_that_is_not_a_repeat_of_itself_is_traced_again():
    """Adafactor's second step makes storages its first does not: traced, not copied; and a window
    that frees a storage made before it is no repeat."""
    from autotune.estimate.trace import repeats_its_first_step
    from autotune.estimate.stack import Stack

    assert not repeats_its_first_step(
        ProbeConfig(model="tiny", micro_batch=1, block_size=32, optimizer="adafactor"), Stack()
    )
    assert not repeats_its_first_step(ProbeConfig(model="tiny", micro_batch=1, block_size=32), Stack(torch="1.13"))
    assert repeats_its_first_step(ProbeConfig(model="tiny", micro_batch=1, block_size=32), Stack())
    ledger = Ledger()
    made_before, made_during = object(), object()
    ledger.events.append((1, made_before, "forward", 16))
    ledger.events += [(1, made_during, "forward", 8), (-1, made_during, "", 8), (-1, made_before, "", 16)]
    assert ledger.repeat_events_from(1) is False and len(ledger.events) == 4


def test_cuda_trace_is_below_cpu_trace_where_attention_matters():
    # No S x S attention matrix and 1-byte dropout masks on CUDA
    cpu = run_trace("cpu", block_size=256)
    gpu = run_trace("cuda", block_size=256)
    assert gpu.breakdown["activations"] < 0.8 * cpu.breakdown["activations"]


def test_cuda_autocast_lists_run_norms_and_softmax_in_fp32():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    lib = emulation.install_cuda_autocast()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, w)
            assert h.dtype == torch.bfloat16  # lower-precision list, as on CPU
            assert torch.nn.functional.layer_norm(h, (8,)).dtype == torch.float32
            assert torch.softmax(h, -1).dtype == torch.float32
            assert torch.log_softmax(h, -1).dtype == torch.float32
            assert torch.pow(h, 3.0).dtype == torch.float32
            assert h.sum().dtype == torch.float32
            assert torch.cat([h, h]).dtype == torch.bfloat16  # CPU-only list entry: passed through
    finally:
        lib._destroy()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU's own lists are back
        assert torch.nn.functional.layer_norm(torch.nn.functional.linear(x, w), (8,)).dtype == torch.bfloat16


def _header_list(text: str, macro: str) -> set[str]:
    body = re.search(rf"#define {macro}\(_\)(.*?)(?:\n\n|\n#)", text, re.S).group(1)
    names = set()
    for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
        names.add(f"{name}.{overload}" if overload else name)
    return names


def test_autocast_lists_match_the_installed_header():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("this torch ships no C++ headers")
    text = header.read_text()
    assert _header_list(text, "AT_FORALL_LOWER_PRECISION_FP") == set(emulation.LOWER_PRECISION_FP)
    assert _header_list(text, "AT_FORALL_FP32") == set(emulation.FP32) - {"norm.Scalar", "norm.ScalarOpt_dim"}
    assert _header_list(text, "AT_FORALL_FP32_SET_OPT_DTYPE") == set(emulation.FP32_SET_OPT_DTYPE)
    assert _header_list(text, "AT_FORALL_PROMOTE") == set(emulation.PROMOTE)


def test_ledger_peak_agrees_with_memtracker():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_GPT2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(fields.pop("model_type"), **fields, use_cache=False)
        )
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        ids = torch.randint(0, 1024, (4, 64))
        ledger = Ledger()
        for p in model.parameters():
            ledger._track(p)
            ledger.set_role(p, "params")
        ledger.started = True
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        reset = register_optimizer_step_post_hook(lambda *a: tracker.reset_mod_stats())
        try:
            with tracker, ledger, ledger.watching_optimizer():
                for _ in range(2):
                    model(input_ids=ids, labels=ids).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        finally:
            reset.remove()
    theirs = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    ours = replay(ledger.events, cuda=False)
    assert ours["peak_bytes"] == theirs
    parts = ours["breakdown"]
    assert sum(parts.values()) == ours["peak_bytes"]
    assert parts["params"] == sum(p.numel() * 4 for p in model.parameters())
    assert parts["optimizer"] >= 2 * parts["params"]  # two Adam moments (plus step counters)


@pytest.mark.parametrize(
    "arch, precision, kernel",
    [
        ({"model_type": "llama", "num_key_value_heads": 2}, "bf16", "flash"),  # flash has grouped heads
        ({"model_type": "llama", "num_key_value_heads": 2}, "fp32", "math"),  # memory-efficient has not
        ({"model_type": "mistral", "num_key_value_heads": 4, "sliding_window": 32}, "bf16", "mem_efficient"),  # a mask
    ],
)
def test_other_architectures_get_the_kernel_cuda_would_pick(arch, precision, kernel):
    model_config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        **arch,
    }
    config = ProbeConfig(model="tiny", micro_batch=2, block_size=64, precision=precision, checkpointing=True)
    result = trace(TraceItem(config=config, model_config=model_config, model_path=None), "cuda")
    assert set(result.kernels) - {"native_dropout"} == {kernel}
    assert result.peak_bytes == sum(result.breakdown.values()) > 0


@pytest.mark.parametrize(
    "family, levers",
    [
        ("pegasus", {"eval_batch": 2, "generation_max_length": 8, "generation_num_beams": 2}),
        ("t5", {"precision": "bf16", "checkpointing": True}),
        ("bert-classification", {"precision": "fp16", "grad_accum": 2}),
        ("bert-mlm", {"attention": "eager"}),
    ],
)
def test_the_copied_second_step_equals_the_traced_one_for_every_task(monkeypatch, family, levers):
    """The same for seq2seq (with evaluation that generates, after the training steps), sequence
    classification and masked LM; on several ranks the copy differs (DDP's and FSDP's buffers), so
    there each step is traced (repeats_its_first_step)."""
    from dataclasses import asdict

    from autotune.estimate import trace as tracing
    from autotune.estimate.trace import repeats_its_first_step
    from autotune.estimate.stack import Stack
    from tests.helpers.tiny_tasks import TASK_OF, TINY

    task = TASK_OF[family]
    extra = {"seq2seq": {"target_length": 16}, "classification": {"num_labels": 3}}.get(task, {})
    config = ProbeConfig(model="tiny", micro_batch=2, block_size=32, task=task, **extra, **levers)
    assert repeats_its_first_step(config, Stack())
    assert not repeats_its_first_step(
        ProbeConfig(model="tiny", micro_batch=2, block_size=32, gpus=2, strategy="ddp"), Stack()
    )

    def traced() -> dict:
        result = trace(TraceItem(config=config, model_config=TINY[family], model_path=None), "cuda")
        return {
            k: v
            for k, v in asdict(result).items()
            if k not in ("build_seconds", "trace_seconds", "replay_seconds", "kernels")
        }

    copied = []
    repeat = Ledger.repeat_events_from
    monkeypatch.setattr(
        Ledger, "repeat_events_from", lambda self, start: copied.append(repeat(self, start)) or copied[-1]
    )
    once = traced()
    assert copied == [True]
    monkeypatch.setattr(tracing, "REPEAT_FIRST_STEP", False)
    assert once == traced()
