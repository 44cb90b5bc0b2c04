"""Evaluation and generation (pass 3): searches whose probes run the evaluation phase (gpt2, eval
batches after the training steps) and generation (a Pegasus-shaped seq2seq model, predict_with_generate
with beams) after the training steps; the phases' peaks on the card and each search's pick.
"""

from __future__ import annotations

import json

from benchmarks.gpu_evidence.common import SectionEnd
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.search import run_search

# google/pegasus-large's shape (568M parameters), and a tiny one of the same family for the CPU mode.
PEGASUS_SHAPED = {
    "model_type": "pegasus",
    "architectures": ["PegasusForConditionalGeneration"],
    "vocab_size": 96103,
    "max_position_embeddings": 1024,
    "d_model": 1024,
    "encoder_layers": 16,
    "decoder_layers": 16,
    "encoder_attention_heads": 16,
    "decoder_attention_heads": 16,
    "encoder_ffn_dim": 4096,
    "decoder_ffn_dim": 4096,
    "is_encoder_decoder": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "scale_embedding": True,
}
TINY_PEGASUS = {
    **PEGASUS_SHAPED,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}


def eval_generation_searches(run: Run) -> dict[str, list[str]]:
    """gpt2 evaluated during training (eval batches after the training steps), and a Pegasus-shaped
    seq2seq model that generates (predict_with_generate, beams); on CPU their tiny shapes."""
    if run.cuda:
        pegasus = run.state / "pegasus-shaped"
        pegasus.mkdir(parents=True, exist_ok=True)
        (pegasus / "config.json").write_text(json.dumps(PEGASUS_SHAPED))
        gpt2 = [
            "--model",
            "gpt2",
            "--gpu-budget",
            "8GiB",
            "--micro-batches",
            "4,8,16",
            "--effective-batch",
            "16",
            "--block-sizes",
            "512",
            "--precisions",
            "bf16",
            "--checkpointing",
            "off,on",
            "--attention",
            "sdpa",
        ]
        seq2seq = [
            "--model",
            str(pegasus),
            "--gpu-budget",
            "16GiB",
            "--micro-batches",
            "2,4,8",
            "--effective-batch",
            "8",
            "--block-sizes",
            "512",
            "--target-length",
            "128",
            "--precisions",
            "bf16",
            "--checkpointing",
            "off,on",
        ]
    else:
        pegasus = run.state / "tiny-pegasus"
        pegasus.mkdir(parents=True, exist_ok=True)
        (pegasus / "config.json").write_text(json.dumps(TINY_PEGASUS))
        # One candidate each: what the CPU mode checks is that the phases run and their figures arrive.
        tiny = [
            "--device",
            "cpu",
            "--no-predict",
            "--micro-batches",
            "2",
            "--effective-batch",
            "2",
            "--precisions",
            "fp32",
            "--checkpointing",
            "off",
            "--measure-seconds",
            "0.2",
        ]
        gpt2 = [
            "--model",
            str(run.tiny_model),
            "--gpu-budget",
            "1GiB",
            "--block-sizes",
            "64",
            "--attention",
            "sdpa",
            *tiny,
        ]
        seq2seq = [
            "--model",
            str(pegasus),
            "--gpu-budget",
            "1GiB",
            "--block-sizes",
            "64",
            "--target-length",
            "16",
            "--attention",
            "sdpa",
            *tiny,
        ]
    return {
        "gpt2_eval": [*gpt2, "--eval-batch", "auto"],
        "seq2seq_generate": [*seq2seq, "--eval-batch", "auto", "--generate", "--num-beams", "2"],
    }


def section_eval_generation(run: Run) -> dict:
    """Searches whose probes run the evaluation (and generation) phases after the training steps:
    the phases' peaks on the card, each run's pick. A search the deadline cut resumes."""
    searches: dict[str, dict] = {}
    for name, args in eval_generation_searches(run).items():
        earlier = run.previous("eval_generation").get("searches", {}).get(name, {})
        if earlier.get("study_status") == "finished":
            searches[name] = earlier
            continue
        try:
            searches[name] = run_search(run, earlier, args, run.db(f"{name}.db"))
        except SectionEnd as end:
            end.figures = {"searches": {**searches, name: end.figures}}
            raise
    return {"searches": searches}
