"""More mistakes a user can fix, each one line on stderr, exit status 2, no traceback, and nothing
written (tests/test_bad_input.py has the first rounds and the helpers). Run in this process through
the real entry point (`autotune.cli.app.main`) where no real process matters: a mistake that is not
refused before a probe or trace process starts fails here, since such tests may start none
(tests/conftest.py). A subprocess only where the output of a library's own logger is the point."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from autotune.vocabulary.errors import BadInput
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import ProbeStatus
from autotune.vocabulary.units import MIN_BUDGET_BYTES, parse_budget
from tests.helpers.models import TINY_GPT2, write_model_dir
from tests.helpers.cli import Unchanged, autotune, invoke, refused


# -- config.json: read, and shapes a probe should not build -----------------------------------------

BAD_CONFIGS = {
    "not-utf8": (None, "is not UTF-8 text (byte 0xe9"),
    "vocab-0": ({"vocab_size": 0}, "has vocab_size 0; training needs at least 2 tokens"),
    "vocab-1": ({"vocab_size": 1}, "has vocab_size 1; training needs at least 2 tokens"),
    "layers-0": ({"n_layer": 0}, "has n_layer 0; a model needs at least 1"),
    "hidden-layers-0": ({"num_hidden_layers": 0}, "has num_hidden_layers 0"),
    "width-0": ({"n_embd": 0}, "has n_embd 0"),
    "vocab-1e13": ({"vocab_size": 10**13}, "its embedding table alone (vocab_size 10,000,000,000,000 x n_embd 64)"),
    "architectures-42": ({"architectures": 42}, "has 'architectures' 42; it must be a list of class names"),
    # One class name as a string is read as the list of it (the name, not its letters, in the message).
    "architectures-str": (
        {"architectures": "GPT2ForTokenClassification"},
        "(GPT2ForTokenClassification: no task autotune trains)",
    ),
}
COMMANDS = {
    "search": ["search", "--gpu-budget", "64MiB", "--device", "cpu"],
    "estimate": ["estimate", "--micro-batch", "1", "--block-size", "32"],
    "plan": ["plan", "--gpu", "h100"],
}


@pytest.mark.parametrize(
    "case, command",
    [(case, command) for case in BAD_CONFIGS for command in ("search", "estimate")] + [("not-utf8", "plan")],
)  # (plan checks the shapes once its trace processes start)
def test_a_config_json_no_probe_should_build_is_refused_before_any_process(work, hermetic_home, case, command):
    overrides, needle = BAD_CONFIGS[case]
    model = write_model_dir(work.parent / "model", **(overrides or {}))
    if overrides is None:
        (model / "config.json").write_bytes(
            json.dumps({**TINY_GPT2, "_name_or_path": "café"}, ensure_ascii=False).encode("latin-1")
        )
    name, *args = COMMANDS[command]
    with Unchanged(work, hermetic_home):
        refused(invoke(name, "--model", str(model), *args), needle)


def test_the_embedding_is_checked_against_the_budget_where_there_is_one(tmp_path):
    from autotune.specs.models import resolve_model

    spec = resolve_model(str(write_model_dir(tmp_path / "m", vocab_size=10**9)))  # 128 GB at 2 bytes a weight
    spec.check_usable()  # (no budget: below what a device can hold)
    with pytest.raises(BadInput, match="more than the --gpu-budget 64.00 GiB; check vocab_size and n_embd"):
        spec.check_usable(budget_bytes=64 * 2**30)
    spec.check_usable(budget_bytes=256 * 2**30)


# -- budgets too small to hold anything --------------------------------------------------------------


@pytest.mark.parametrize("budget", ["1B", "1.5", "512KiB"])
@pytest.mark.parametrize(
    "command",
    [
        ["search", "--device", "cpu"],
        ["probe", "--micro-batch", "1", "--block-size", "32", "--device", "cpu"],
        ["estimate", "--micro-batch", "1", "--block-size", "32"],
        ["plan", "--gpu", "cpu"],
        ["train", "--dataset", "corpus.txt"],
    ],
)
def test_a_budget_below_1_MiB_is_refused(work, hermetic_home, tiny_model, command, budget):
    with Unchanged(work, hermetic_home):
        refused(
            invoke(command[0], "--model", tiny_model, *command[1:], "--gpu-budget", budget),
            f"--gpu-budget: {budget!r} is ",
        )
    assert parse_budget("1MiB") == MIN_BUDGET_BYTES and parse_budget("2MiB") == 2 * MIN_BUDGET_BYTES  # the tests' own


# -- --db and $AUTOTUNE_DB that name no database -----------------------------------------------------

BAD_DATABASES = {
    "malformed-url": (
        "postgresql+psycopg://u:pw@[::1:bad/x",
        "cannot read 'postgresql+psycopg://u:***@[::1:bad/x' as a database URL",
    ),
    "name-too-long": ("{work}/" + "a" * 300 + ".db", "(File name too long); give a shorter path"),
    "a-word": ("garbage", "'garbage': neither a database URL (scheme://"),
    "a-directory": ("{work}", "that is a directory; give a file in it"),
}


@pytest.mark.parametrize("how", ["--db", "AUTOTUNE_DB"])
@pytest.mark.parametrize("command", [["db", "upgrade"], ["studies"]])
@pytest.mark.parametrize("case", list(BAD_DATABASES))
def test_a_database_value_that_names_no_database_is_one_line(work, hermetic_home, case, command, how):
    value, needle = BAD_DATABASES[case]
    value = value.format(work=work)
    args, env = (["--db", value], None) if how == "--db" else ([], {"AUTOTUNE_DB": value})
    with Unchanged(work, hermetic_home):
        proc = invoke(*command, *args, env=env)
    refused(proc, needle)
    assert proc.stderr.startswith(f"autotune: error: {'$AUTOTUNE_DB' if env else '--db'}")


@pytest.mark.parametrize("value", ["abc", "0", "-3", "17"])
@pytest.mark.parametrize("command", [["plan", "--gpu", "h100"], ["search", "--gpu-budget", "64MiB", "--device", "cpu"]])
def test_a_trace_process_count_that_is_no_count_is_one_line_before_any_process(
    work, hermetic_home, tiny_model, command, value
):
    name, *args = command
    with Unchanged(work, hermetic_home):
        refused(
            invoke(name, "--model", tiny_model, *args, env={"AUTOTUNE_TRACE_PROCESSES": value}),
            f"$AUTOTUNE_TRACE_PROCESSES {value!r}: give a whole number of trace processes from 1 to 16",
        )


@pytest.mark.slow
def test_search_into_a_stray_word_creates_no_database(work, hermetic_home, tiny_model):
    # (Old code: ./garbage created, and the search's results written into it.)
    with Unchanged(work, hermetic_home):
        refused(
            autotune(
                "search",
                "--model",
                tiny_model,
                "--gpu-budget",
                "64MiB",
                "--device",
                "cpu",
                env={"AUTOTUNE_DB": "garbage"},
                timeout=120,
            ),
            "$AUTOTUNE_DB 'garbage': neither a database URL",
        )


# -- probe: the one config asked for cannot run here -------------------------------------------------


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--allocator", "expandable"], "CPU memory has no such allocator"),
        (["--liger"], "none run on CPU"),
        (["--precision", "tf32"], "there is no TF32 on CPU"),
        (["--attention", "flash_attention_2"], "attention 'flash_attention_2': not available here"),
        (["--compile", "--max-compile-seconds", "1"], "torch.compile took 3.0 s, over --max-compile-seconds 1"),
    ],
)
def test_probe_refuses_the_one_config_it_cannot_run_here(work, hermetic_home, tiny_model, args, reason):
    # What the probe child answers (tests/probe/test_speed_levers.py runs it for real), as the command sees it.
    skipped = ProbeResult(status=ProbeStatus.SKIPPED, budget_bytes=2**30, error=reason)
    with Unchanged(work, hermetic_home), mock.patch("autotune.probe.run_probe", return_value=skipped):
        for json_flag in ([], ["--json"]):
            refused(
                invoke(
                    "probe",
                    "--model",
                    tiny_model,
                    "--micro-batch",
                    "1",
                    "--block-size",
                    "32",
                    "--gpu-budget",
                    "1GiB",
                    "--device",
                    "cpu",
                    *args,
                    *json_flag,
                ),
                f"cannot be probed here: {reason}",
            )


@pytest.mark.slow
def test_probe_of_a_cuda_allocator_on_cpu_is_a_mistake(work, hermetic_home, tiny_model):
    # (Old code: exit status 1, "skipped", as if the config did not fit.)
    with Unchanged(work, hermetic_home):
        refused(
            autotune(
                "probe",
                "--model",
                tiny_model,
                "--micro-batch",
                "1",
                "--block-size",
                "32",
                "--gpu-budget",
                "64MiB",
                "--device",
                "cpu",
                "--allocator",
                "expandable",
                timeout=120,
            ),
            "(mb1x1 blk32 fp32 no-ckpt sdpa expandable) cannot be probed here: allocator expandable",
        )


# -- train --dataset: one line, not the data library's log line first --------------------------------


@pytest.mark.parametrize(
    "name, text, needle",
    [
        (
            "broken.jsonl",
            '{"text": "a"}\n{"text": oops\n',
            "(JSON parse error: Invalid value. in row 1); a .json or .jsonl",
        ),
        ("text.parquet", "just some text\n", "(Parquet magic bytes not found in footer."),
        ("number.json", "42\n", "); a .json or .jsonl file holds JSON objects, one per line (or one list of them)."),
    ],
)
def test_a_data_file_that_cannot_be_read_is_one_line(work, hermetic_home, tiny_model, name, text, needle):
    # A subprocess: the data library logs through its own handler on the real stderr.
    (work / name).write_text(text)
    with Unchanged(work, hermetic_home):
        proc = autotune(
            "train", "--model", tiny_model, "--gpu-budget", "64MiB", "--device", "cpu", "--dataset", name, timeout=120
        )
    refused(proc, needle)
    assert f"--dataset {name}: cannot read it (" in proc.stderr


@pytest.mark.parametrize("files", [[], ["notes.md"], [".hidden/a.txt"]])
def test_a_dataset_directory_without_data_files_says_so(work, hermetic_home, tiny_model, files):
    for file in files:
        (work / "data" / file).parent.mkdir(parents=True, exist_ok=True)
        (work / "data" / file).write_text("some text\n")
    (work / "data").mkdir(exist_ok=True)
    with Unchanged(work, hermetic_home):
        refused(
            invoke("train", "--model", tiny_model, "--gpu-budget", "64MiB", "--device", "cpu", "--dataset", "data"),
            "--dataset data: the directory holds no .txt, .json, .jsonl, .csv, .tsv or .parquet file",
        )


# -- files to write: their type and their directory, checked before any work --------------------------


@pytest.mark.parametrize(
    "command, needle",
    [
        (["plan", "--model", "{model}", "--gpu", "h100", "--plot", "plan.txt"], "--plot: cannot draw a .txt file"),
        (
            ["plan", "--model", "{model}", "--gpu", "h100", "--plot", "{work}/no/such/p.png"],
            "--plot {work}/no/such/p.png: the directory {work}/no/such does not exist",
        ),
        (
            ["plot", "--out", "{work}/no/such/x.png"],
            "--out {work}/no/such/x.png: the directory {work}/no/such does not exist",
        ),
        (
            ["report", "--out", "{work}/no/such/r.md"],
            "--out {work}/no/such/r.md: the directory {work}/no/such does not exist",
        ),
        (["report", "--plot", "{work}/no/such/r.png"], "--plot {work}/no/such/r.png: the directory {work}/no/such"),
        (["report", "--plot", "r.txt"], "--plot: cannot draw a .txt file"),
    ],
)
def test_a_file_that_cannot_be_written_is_refused_before_any_work(work, hermetic_home, tiny_model, command, needle):
    pytest.importorskip("matplotlib")
    # plan: refused before its traces start (a non-slow test may start none); plot, report: before
    # the database is read, and no directory is made.
    with Unchanged(work, hermetic_home):
        refused(invoke(*[part.format(model=tiny_model, work=work) for part in command]), needle.format(work=work))
    assert not (work / "no").exists()


# -- the run's evaluation (autotune/levers/evaluation.py): refused before any process, nothing written -----

EVAL_MISTAKES = {
    "not-a-number": (["--eval-batch", "abc"], "'abc' is neither a whole number nor auto"),
    "zero": (["--eval-batch", "0"], "--eval-batch must be a whole number of at least 1 (got 0)"),
    "unknown-logits": (["--eval-batch", "4", "--eval-logits", "maybe"], "'maybe' is not one of 'loss-only', 'kept'"),
    "kept-without-batch": (["--eval-logits", "kept"], "--eval-logits kept describes evaluation: give --eval-batch too"),
    "accumulation-0": (
        ["--eval-batch", "4", "--eval-logits", "kept", "--eval-accumulation-steps", "0"],
        "--eval-accumulation-steps must be a whole number of at least 1 (got 0)",
    ),
    "accumulation-loss-only": (["--eval-batch", "4", "--eval-accumulation-steps", "2"], "it needs --eval-logits kept"),
    "generate-causal-lm": (["--eval-batch", "4", "--generate"], "--generate is for --task seq2seq"),
    "beams-without-generate": (["--eval-batch", "4", "--num-beams", "4"], "are generation's: give --generate too"),
}


@pytest.mark.parametrize("case", EVAL_MISTAKES)
@pytest.mark.parametrize("command", ("search", "estimate"))
def test_an_evaluation_flag_that_makes_no_sense_is_one_line_before_any_process(work, hermetic_home, case, command):
    model = str(write_model_dir(work / "tiny"))
    flags, needle = EVAL_MISTAKES[case]
    with Unchanged(work, hermetic_home):
        refused(invoke(*COMMANDS[command], "--model", model, *flags), needle)
