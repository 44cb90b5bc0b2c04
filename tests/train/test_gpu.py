"""`autotune train` on a GPU: gpt2 (random init from its config) on a local corpus, 200 steps with
the configuration a search chose under 8 GiB. The run must not run out of memory, and its peak plus
the CUDA context must stay within the budget. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import autotune
from tests.helpers.corpus import corpus_text, write_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # (it starts probe and training processes)
GiB = 2**30


def test_gpt2_trains_200_steps_within_8gib_with_the_searched_config(tmp_path):
    text = corpus_text()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    tokenizer = tmp_path / "tokenizer"
    write_tokenizer(text, tokenizer)  # 500 tokens: within gpt2's 50,257 embeddings
    db = f"sqlite:///{tmp_path / 'gpu.db'}"

    search = autotune(
        "search",
        "--model",
        "gpt2",
        "--gpu-budget",
        "8GiB",
        "--device",
        "cuda",
        "--study",
        "gpt2-gpu",
        "--micro-batches",
        "4,8,16,32",
        "--block-sizes",
        "512",
        "--effective-batch",
        "32",
        "--precisions",
        "bf16,fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--db",
        db,
        timeout=900,
    )
    assert search.returncode == 0, search.stderr[-3000:]
    print(search.stdout)

    out = tmp_path / "run"
    proc = autotune(
        "train",
        "--study",
        "gpt2-gpu",
        "--dataset",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--max-steps",
        "200",
        "--save-steps",
        "100",
        "--device",
        "cuda",
        "--output-dir",
        str(out),
        "--db",
        db,
        "--json",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    print(proc.stderr[-2000:])
    assert summary["status"] == "finished" and summary["steps"] == 200
    assert summary["weights"] == "random-init"
    required = summary["peak_reserved_bytes"] + summary["context_bytes"]
    probe = summary["probe"]
    print(
        f"run peak reserved {summary['peak_reserved_bytes'] / GiB:.2f} GiB (+ context {summary['context_bytes'] / GiB:.2f}) "
        f"vs probe {probe['peak_reserved_bytes'] / GiB:.2f} GiB (+ {(probe['context_bytes'] or 0) / GiB:.2f}); "
        f"run/probe {summary['peak_vs_probe']:.3f}; {summary['tokens_per_s']:,.0f} tokens/s vs probe "
        f"{probe['tokens_per_s']:,.0f}; config {summary['config']['label']}"
    )
    assert required <= 8 * GiB, summary
    assert summary["tokens_per_s"] > 0 and summary["final_loss"] is not None
