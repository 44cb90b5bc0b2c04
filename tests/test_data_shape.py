"""The user's data gives the longest batch to probe (autotune.data.shape): a padded task's block sizes
and target length capped at its longest example, what the search says about it, and the mistakes
around --dataset (one line, exit 2, nothing written)."""

from __future__ import annotations

import csv

import pytest

from autotune.data.options import DataOptions
from autotune.data.shape import shaped_space_args
from autotune.levers.tasks import DataShape
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import resolve_model
from autotune.search.space import SearchSpace
from tests.helpers.cli import assert_usage_error, invoke
from tests.helpers.tiny_tasks import write_tiny
from tests.helpers.corpus import write_task_tokenizer
from tests.helpers.models import write_model_dir

TEXT = "the quick brown fox jumps over the lazy dog and runs far away from the farm " * 20


def test_the_longest_example_caps_block_sizes_and_the_target_and_is_said():
    shape = DataShape("pairs.jsonl", "seq2seq", 100, longest=90, longest_target=23)
    assert shape.block_sizes((64, 128, 256)) == (64, 90)
    assert shape.target_length(128) == 23 and shape.target_length(16) == 16
    note = shape.note((64, 128, 256), 128)
    assert "longest of its 100 examples is 90 tokens + 23 target tokens" in note
    assert "probing batches of 64/90+23 tokens (not 64/128/256+128" in note and "attention mask" in note
    packed = DataShape("corpus.txt", "causal-lm", 10)
    assert packed.block_sizes((512,)) == (512,) and "full blocks" in packed.note((512,), None)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("data-shape")
    model = write_tiny(root, "bert-classification")
    write_task_tokenizer(TEXT, model, vocab_size=60)
    data = root / "reviews.csv"
    with data.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows([" ".join(TEXT.split()[:n]), ("neg", "pos")[n % 2]] for n in (3, 10, 17))
    return model, data


def test_a_classifiers_data_gives_its_longest_batch_and_its_labels(bert):
    model, data = bert
    spec = resolve_model(str(model))
    args = shaped_space_args(spec, {"data": DataOptions(str(data)), "block_sizes": (128, 256), "effective_batch": 8})
    shape = args["data_shape"]
    # 17 words, as the run's encoder tokenises them (this word-level tokenizer adds no special tokens).
    assert (shape.examples, shape.longest, shape.longest_target, shape.labels) == (3, 17, None, 2)
    assert args["num_labels"] == 2 and "data" not in args
    space = SearchSpace.build(spec, **args)
    assert space.block_sizes == (17,) and space.num_labels == 2
    assert len(space.notes) == 1 and "probing batches of 17 tokens (not 128/256" in space.notes[0]
    assert "notes" not in space.to_dict() and SearchSpace.from_stored(space.to_dict()) == space
    with pytest.raises(BadInput, match="--effective-tokens 4096 was meant for blocks of 128/256 tokens"):
        SearchSpace.build(spec, **{**args, "effective_batch": None, "effective_tokens": 4096})


def test_a_space_says_what_it_assumed_of_the_runs_batches(bert, tmp_path):
    """Without --dataset a padded task's probes run the worst batch; with --trainer trl they run full
    blocks (TRL's packing: true), not TRL's default per-example padding: each said, once."""
    model, data = bert
    classifier = SearchSpace.build(resolve_model(str(model)), effective_batch=8)
    assert [n for n in classifier.notes if "no --dataset" in n] == [
        "no --dataset: every classification batch probed is the worst a run can form, each row as long as the block "
        "(padding counted as tokens); give --dataset to time batches of your data's lengths"
    ]
    gpt2 = resolve_model(str(write_model_dir(tmp_path / "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=100)))
    assert SearchSpace.build(gpt2, effective_batch=8).notes == ()
    trl = SearchSpace.build(gpt2, effective_batch=8, trainer="trl").notes
    assert len(trl) == 1 and trl[0].startswith("--trainer trl: the probes time full blocks, as TRL trains with packing")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--text-column", "body"], "--text-column describes the data: give --dataset too"),
        (["--dataset", "missing.csv"], "missing.csv"),
        (["--dataset", "DATA", "--text-column", "body"], "--text-column 'body'"),
        (["--dataset", "DATA", "--tokenizer", "/nowhere"], "/nowhere"),
    ],
)
def test_dataset_mistakes_are_one_line_and_exit_2_with_nothing_written(bert, tmp_path, flags, needle, warm_child):
    model, data = bert
    db = tmp_path / "results.db"
    flags = [str(data) if flag == "DATA" else flag for flag in flags]
    # (In this process, with the worker's warm probe child; no trace child: no prediction is asked.)
    proc = invoke(
        "search",
        "--model",
        str(model),
        "--gpu-budget",
        "64MiB",
        "--device",
        "cpu",
        "--no-predict",
        "--db",
        f"sqlite:///{db}",
        *flags,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert_usage_error(proc, needle)
    assert not db.exists()


def test_the_dataset_flags_are_one_definition_for_search_plan_and_train():
    from autotune.cli import cli

    def names(command: str) -> set[str]:
        return {option for param in cli.commands[command].params for option in param.opts}

    flags = {"--dataset", "--text-column", "--target-column", "--label-column", "--tokenizer"}
    for command in ("search", "plan", "train"):
        assert flags <= names(command), command
    helps = {
        command: next(p.help for p in cli.commands[command].params if "--tokenizer" in p.opts)
        for command in ("search", "plan", "train")
    }
    assert len(set(helps.values())) == 1
