"""The data's lengths and what they make of a padded run's batches (autotune.levers.lengths): the
expectations against batches drawn at random, the probe's timed draws, a config's real tokens, and
where the search, the leaderboard and the hand-offs read them. No process, no timing."""

from __future__ import annotations

import random
import statistics

import pytest

from autotune.levers import lengths
from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.results.timing import window_seconds

from tests.helpers.lengths import BLOCK, DATA, TEXT, long_tailed
from tests.helpers.store import best_of, leaderboard_row


def test_the_quantiles_keep_the_datas_spread_in_a_few_hundred_characters():
    kept = lengths.Lengths.from_text(TEXT)
    assert len(kept.points) == lengths.QUANTILES and len(TEXT) < 400
    assert kept.mean(BLOCK) == pytest.approx(statistics.fmean(DATA), rel=0.02)
    assert kept.points[lengths.QUANTILES // 2] == pytest.approx(statistics.median(DATA), abs=1)
    assert lengths.Lengths.of([7]).points == (7,) * lengths.QUANTILES  # one example: every quantile is it


@pytest.mark.parametrize(
    "text",
    [
        "12,13",
        "q" + ",".join(["5"] * 63),
        "q" + ",".join(["x"] * 64),
        "q" + ",".join(["9"] * 63 + ["1"]),
        "q" + ",".join(["0"] * 64),
    ],
)
def test_lengths_that_are_not_64_sorted_counts_are_refused(text):
    with pytest.raises(BadInput):
        lengths.Lengths.from_text(text)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_the_expected_padding_is_what_random_batches_of_the_data_pad(rows):
    """Against batches drawn at random from the 4,000 examples themselves (not the quantiles)."""
    rng = random.Random(rows)
    batches = [rng.sample(DATA, rows) for _ in range(20000)]
    real = sum(sum(b) for b in batches)
    padded = sum(rows * max(b) for b in batches)
    assert lengths.expected_padded_row(TEXT, rows, BLOCK) == pytest.approx(padded / (rows * len(batches)), rel=0.03)
    assert lengths.padding_share(TEXT, rows, BLOCK) == pytest.approx(1 - real / padded, abs=0.02)


def test_padding_grows_with_the_micro_batch_and_a_lower_block_cuts_it():
    shares = [lengths.padding_share(TEXT, rows, BLOCK) for rows in (1, 2, 4, 8)]
    assert shares[0] == 0 and shares == sorted(shares) and shares[-1] > 0.55  # (61% measured in TRL's collator)
    assert lengths.padding_share(TEXT, 8, 32) < shares[-1]


@pytest.mark.parametrize("micro_batch, accumulation", [(1, 8), (2, 4), (8, 1), (3, 1), (16, 4)])
def test_each_timed_cycle_draws_every_length_equally_and_pads_as_the_data_does(micro_batch, accumulation):
    rows_per_step = micro_batch * accumulation
    steps = lengths.cycle_steps(rows_per_step)
    cut = sorted(min(p, BLOCK) for p in lengths.Lengths.from_text(TEXT).points)
    for cycle in range(3):
        rows = lengths.timing_rows(TEXT, micro_batch, rows_per_step, BLOCK, cycle)
        assert len(rows) == steps * rows_per_step and len(rows) % lengths.QUANTILES == 0
        assert sorted(rows) == sorted(cut * (len(rows) // lengths.QUANTILES))  # each quantile equally often
        padded = sum(micro_batch * max(rows[i : i + micro_batch]) for i in range(0, len(rows), micro_batch))
        expected = lengths.expected_padded_row(TEXT, micro_batch, BLOCK) * len(rows)
        assert padded == pytest.approx(expected, rel=0.02)
        assert rows == lengths.timing_rows(TEXT, micro_batch, rows_per_step, BLOCK, cycle)  # the same in every process
    assert lengths.timing_rows(TEXT, 2, 8, BLOCK, 0) != lengths.timing_rows(TEXT, 2, 8, BLOCK, 1)


def test_a_window_of_drawn_batches_is_its_mean_step_and_the_noise_between_its_cycles():
    # Two cycles of 4 steps whose batches differ (2, 1, 1, 4 seconds) but repeat alike: no noise.
    seconds, spread = window_seconds([2.0, 1.0, 1.0, 4.0] * 2, cycle=4)
    assert seconds == 2.0 and spread == 0.0
    seconds, spread = window_seconds(
        [2.0, 1.0, 1.0, 4.0, 2.2, 1.1, 1.1, 4.4, 9.0], cycle=4
    )  # (a cycle cut short: left out)
    assert seconds == pytest.approx(2.1) and spread == pytest.approx(0.1 / (2 * 2.1))
    assert window_seconds([1.0, 3.0, 2.0]) == (2.0, 0.25)  # steps of one shape: the median, as before


def config(micro_batch: int = 2, **changes) -> ProbeConfig:
    return ProbeConfig(
        **{
            "model": "gpt2",
            "micro_batch": micro_batch,
            "grad_accum": 8 // micro_batch,
            "block_size": BLOCK,
            "trainer": "trl",
            "lengths": TEXT,
            **changes,
        }
    )


def test_a_config_of_the_datas_lengths_counts_real_tokens_and_keys_apart():
    padded, plain = config(8), config(8, lengths=None)
    assert plain.tokens_per_step == 8 * BLOCK and plain.padding_share is None and plain.timing_cycle is None
    assert padded.tokens_per_step == pytest.approx(8 * statistics.fmean(DATA), rel=0.02)
    assert padded.padded_tokens_per_step / padded.tokens_per_step == pytest.approx(padded.padded_per_real)
    assert padded.padding_share == pytest.approx(1 - 1 / padded.padded_per_real)
    assert padded.key() != plain.key() and "lengths" not in plain.key_fields() and padded.label() == plain.label()
    assert config(8, lengths=lengths.Lengths.of(long_tailed(seed=1)).to_text()).key() != padded.key()


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"lengths": "q1,2"}, "64 whole numbers"),
        ({"task": "seq2seq", "target_length": 16, "trainer": "transformers"}, "not seq2seq"),
        ({"task": "masked-lm", "trainer": "transformers"}, "not masked-lm"),
    ],
)
def test_lengths_are_for_a_classifier_and_a_causal_lm_trained_per_example(changes, words):
    with pytest.raises(BadInput, match=words):
        config(**changes)


def row(micro_batch: int, tokens_per_s: float, spread: float = 0.02, **changes):
    import dataclasses

    return dataclasses.replace(
        leaderboard_row(config(micro_batch, **changes)), tokens_per_s=tokens_per_s, step_spread=spread
    )


def test_the_leaderboard_names_a_larger_micro_batch_slower_on_this_data():
    from autotune.render.tables import larger_batch_slower, render_leaderboard

    rows = [row(2, 1250.0), row(4, 1020.0), row(8, 710.0), row(1, 1100.0)]
    said = larger_batch_slower(rows)
    assert said is not None and "mb8x1" in said and "0.57x" in said and "61%" in said and "31%" in said
    table = render_leaderboard(rows)
    assert "real tokens/s" in table and "padding" in table.splitlines()[0] and "note: on this data" in table
    # Within their noise, or without the data's lengths (full blocks): nothing said.
    assert larger_batch_slower([row(2, 1000.0, 0.2), row(8, 900.0, 0.2)]) is None
    assert larger_batch_slower([row(2, 1000.0, lengths=None), row(8, 700.0, lengths=None)]) is None
    assert "real tokens/s" not in render_leaderboard([row(2, 1000.0, lengths=None)])


def test_the_hand_offs_train_one_example_per_row_where_the_probes_did():
    from autotune.handoff.scripts import cli_flags
    from autotune.handoff.tools import axolotl_document, llamafactory_document, trl_document

    per_example, packed = best_of(config(2)), best_of(config(2, lengths=None))
    assert trl_document(per_example)["packing"] is False and "packing_strategy" not in trl_document(per_example)
    assert (trl_document(packed)["packing"], trl_document(packed)["packing_strategy"]) == (True, "wrapped")
    assert axolotl_document(per_example)["sample_packing"] is False
    assert axolotl_document(per_example)["pad_to_sequence_len"] is False
    assert "sample_packing" not in axolotl_document(packed) and axolotl_document(packed)["pad_to_sequence_len"]
    assert llamafactory_document(per_example)["packing"] is False and "packing" not in llamafactory_document(packed)
    classifier = dict(task="classification", num_labels=2, trainer="transformers")
    assert "--pad_to_max_length False" in cli_flags(best_of(config(2, **classifier)))
    assert "--pad_to_max_length False" not in cli_flags(best_of(config(2, **classifier, lengths=None)))


@pytest.mark.parametrize(
    "name, text, packing, source",
    [
        ("trl.yml", "model_name_or_path: gpt2\nmax_length: 256\n", "off", "packing (default false)"),
        ("trl.yml", "model_name_or_path: gpt2\nmax_length: 256\npacking: true\n", "on", "packing"),
        ("a.yml", "base_model: gpt2\nsequence_len: 256\n", "off", "sample_packing (default false)"),
        ("a.yml", "base_model: gpt2\nsequence_len: 256\nsample_packing: true\n", "on", "sample_packing"),
        ("a.yml", "base_model: gpt2\nsequence_len: 256\npad_to_sequence_len: true\n", "on", "pad_to_sequence_len"),
        ("lf.yml", "model_name_or_path: gpt2\nstage: sft\n", "off", "packing (default false)"),
        ("lf.yml", "model_name_or_path: gpt2\nstage: pt\n", "on", "packing (default true)"),
    ],
)
def test_each_tools_file_says_whether_its_examples_are_packed(tmp_path, name, text, packing, source):
    from autotune.recipe_files import read_recipe_file

    path = tmp_path / name
    path.write_text(text)
    read = read_recipe_file(path)
    assert read.flags["packing"] == packing and read.sources["packing"].startswith(source)


def test_a_padding_free_trl_file_is_searched_padding_free(tmp_path):
    from autotune.recipe_files import read_recipe_file

    path = tmp_path / "trl.yml"
    path.write_text("model_name_or_path: gpt2\nmax_length: 256\npadding_free: true\n")
    assert read_recipe_file(path).flags["padding_free"] == "on"
    path.write_text("model_name_or_path: gpt2\nmax_length: 256\npacking: true\npadding_free: true\n")
    assert "padding_free" not in read_recipe_file(path).flags  # (TRL's packed blocks: full blocks, as timed)
    path.write_text("model_name_or_path: gpt2\nmax_length: 256\npadding_free: 1\n")
    with pytest.raises(BadInput, match="padding_free: 1 is not true or false"):
        read_recipe_file(path)
    path.write_text("model_name_or_path: gpt2\nmax_length: 64\npacking: maybe\n")
    with pytest.raises(BadInput, match="packing: 'maybe' is not true or false"):
        read_recipe_file(path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from autotune.specs.models import resolve_model
    from tests.helpers.models import write_model_dir

    return resolve_model(
        str(
            write_model_dir(tmp_path_factory.mktemp("lengths") / "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=100)
        )
    )


def test_a_causal_lm_trained_per_example_draws_its_batches_from_the_datas_lengths(gpt2):
    from autotune.search.space import SearchSpace
    from autotune.levers.tasks import DataShape

    shape = DataShape("sft.jsonl", "causal-lm", 4000, longest=max(DATA), lengths=TEXT)
    space = SearchSpace.build(
        gpt2, effective_batch=8, block_sizes=(256,), trainer="trl", packing=False, data_shape=shape
    )
    assert space.lengths == TEXT and space.block_sizes == (BLOCK,)  # (no example is longer than 128)
    assert {c.lengths for c in space.candidates()} == {TEXT} and SearchSpace.from_stored(space.to_dict()) == space
    assert "timed on batches drawn from its lengths (mean 34, median 24" in space.notes[0]
    packed = SearchSpace.build(gpt2, effective_batch=8, trainer="trl", data_shape=DataShape("c.txt", "causal-lm", 10))
    assert packed.lengths is None and "lengths" not in packed.to_dict()
    assert "give --packing off with --dataset" in packed.notes[-1]
    assumed = SearchSpace.build(gpt2, effective_batch=8, packing=False)
    assert assumed.lengths is None and "--packing off) probed is the worst a run can form" in assumed.notes[0]


def test_packing_off_is_refused_for_a_task_whose_examples_are_padded_already(tmp_path):
    from autotune.specs.models import resolve_model
    from autotune.search.space import SearchSpace
    from tests.helpers.tiny_tasks import write_tiny

    bert = resolve_model(str(write_tiny(tmp_path, "bert-classification")))
    with pytest.raises(BadInput, match="--packing off is for --task causal-lm"):
        SearchSpace.build(bert, effective_batch=8, packing=False)


def test_grouped_by_length_each_micro_batch_is_of_about_one_length_and_pads_little():
    grouped = [
        lengths.padding_share(TEXT, rows, BLOCK, rows_per_step=8, sampling="group_by_length") for rows in (2, 4, 8)
    ]
    drawn = [lengths.padding_share(TEXT, rows, BLOCK) for rows in (2, 4, 8)]
    assert all(g < d / 3 for g, d in zip(grouped, drawn)) and grouped[-1] < 0.2, (grouped, drawn)
    rows = lengths.timing_rows(TEXT, 4, 8, BLOCK, 3, "group_by_length")
    assert rows == sorted(rows, reverse=True) == lengths.timing_rows(TEXT, 4, 8, BLOCK, 0, "group_by_length")
    cut = sorted(min(p, BLOCK) for p in lengths.Lengths.from_text(TEXT).points)
    assert sorted(rows) == sorted(cut * (len(rows) // lengths.QUANTILES))  # every length, equally often
    config_grouped = config(4, sampling="group_by_length")
    assert config_grouped.label().endswith(" trl grouped") and config_grouped.key() != config(4).key()
    assert config_grouped.tokens_per_step == config(4).tokens_per_step  # the same examples: other batches
    assert config_grouped.padded_tokens_per_step < config(4).padded_tokens_per_step
    with pytest.raises(BadInput, match="groups batches by the data's lengths: give --dataset"):
        config(4, sampling="group_by_length", lengths=None)
    with pytest.raises(BadInput, match="--sampling 'sorted' is unknown"):
        config(4, sampling="sorted")


def test_the_sampler_is_handed_off_as_each_tool_names_it_and_read_back_from_its_files(tmp_path):
    from autotune.handoff.argument_names import sampling_arguments
    from autotune.handoff.tools import axolotl_document, llamafactory_document, trl_document
    from autotune.recipe_files import read_recipe_file

    best = best_of(config(4, sampling="group_by_length"))
    key = next(iter(sampling_arguments("group_by_length")))
    assert key in ("train_sampling_strategy", "group_by_length") and sampling_arguments("random") == {}
    assert trl_document(best)[key] in ("group_by_length", True) and key in best.trainer_kwargs()
    assert axolotl_document(best)["group_by_length"] is True
    assert llamafactory_document(best)["train_sampling_strategy"] == "group_by_length"
    assert "group_by_length" not in axolotl_document(best_of(config(4)))
    for name, text in (
        ("trl.yml", "model_name_or_path: gpt2\nmax_length: 64\ngroup_by_length: true\n"),
        ("trl2.yml", "model_name_or_path: gpt2\nmax_length: 64\ntrain_sampling_strategy: group_by_length\n"),
        ("a.yml", "base_model: gpt2\nsequence_len: 64\ngroup_by_length: true\n"),
    ):
        (tmp_path / name).write_text(text)
        assert read_recipe_file(tmp_path / name).flags["sampling"] == "group_by_length"
    (tmp_path / "bad.yml").write_text("model_name_or_path: gpt2\nmax_length: 64\ntrain_sampling_strategy: curriculum\n")
    with pytest.raises(BadInput, match="train_sampling_strategy: 'curriculum'"):
        read_recipe_file(tmp_path / "bad.yml")


def test_a_space_may_choose_the_sampler_only_over_the_datas_lengths(gpt2):
    from autotune.search.space import SearchSpace
    from autotune.levers.tasks import DataShape

    shape = DataShape("sft.jsonl", "causal-lm", 4000, longest=max(DATA), lengths=TEXT)
    space = SearchSpace.build(
        gpt2,
        effective_batch=8,
        block_sizes=(128,),
        packing=False,
        data_shape=shape,
        micro_batches=(2, 8),
        samplings=("random", "group_by_length"),
    )
    assert {(c.micro_batch, c.sampling) for c in space.candidates()} == {
        (2, "group_by_length"),
        (2, "random"),
        (8, "group_by_length"),
        (8, "random"),
    }
    assert (
        space.to_dict()["samplings"] == ["random", "group_by_length"]
        and SearchSpace.from_stored(space.to_dict()) == space
    )
    with pytest.raises(BadInput, match="--sampling group_by_length groups batches by the data's lengths"):
        SearchSpace.build(gpt2, effective_batch=8, samplings=("group_by_length",))
