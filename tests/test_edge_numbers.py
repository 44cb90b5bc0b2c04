"""Values at the edge (issue 48): config.json sizes, numbers without an upper bound or NaN, ranks and
rendezvous, and `worker`/`node` checked as `search` is. Each mistake is one line on stderr, exit
status 2, refused before any work (a non-slow test may start no probe or trace process:
tests/conftest.py) and with nothing written. Run in this process through the real entry point."""

from __future__ import annotations

import json
from unittest import mock

import click
import pytest

from autotune.flags.values import COUNT, STEPS, WholeNumber
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import MAX_DEVICE_BYTES, resolve_model
from autotune.levers.sharding import cpu_rank_problems, most_cpu_ranks
from autotune.vocabulary.units import INT64_MAX, MAX_SECONDS, MAX_STEPS, parse_duration
from tests.helpers.models import write_model_dir
from tests.helpers.cli import Unchanged, invoke, refused

NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # what a machine without a GPU answers, here and on one with a GPU
COMMANDS = {
    "search": ["search", "--gpu-budget", "1GiB", "--device", "cpu"],
    "probe": ["probe", "--micro-batch", "1", "--block-size", "8", "--gpu-budget", "1GiB", "--device", "cpu"],
    "estimate": ["estimate", "--micro-batch", "1", "--block-size", "8", "--gpu-budget", "1GiB"],
}


@pytest.fixture
def model(work):
    return str(write_model_dir(work.parent / "tiny"))


# -- 5. config.json values: one validation where the config is read ----------------------------------

BAD_VALUES = {
    "positions-0": ({"n_positions": 0, "n_ctx": 0}, "has n_positions 0; a model needs at least 1"),
    "max-positions-negative": ({"max_position_embeddings": -5}, "has max_position_embeddings -5"),
    "layers-text": ({"n_layer": "2"}, "has n_layer '2', not a whole number; write it as a number (2), without quotes"),
    "width-float": ({"n_embd": 64.0}, "has n_embd 64.0, not a whole number; give n_embd as a whole number"),
    "heads-bool": ({"n_head": True}, "has n_head true, not a whole number"),
    "inner-text": ({"n_inner": "wide"}, "has n_inner 'wide', not a whole number"),
    "vocab-text": ({"vocab_size": "1024"}, "has vocab_size '1024', not a whole number"),
    "kv-heads-0": ({"num_key_value_heads": 0}, "has num_key_value_heads 0"),
    # The learned position table (n_positions x n_embd at 2 bytes), as the embedding table: past the budget.
    "positions-1e12": (
        {"n_positions": 10**12, "n_ctx": 10**12},
        "its position table alone (n_positions 1,000,000,000,000 x n_embd 64) needs at least",
    ),
    # More than any device holds whatever the budget: refused where the config is read.
    "layers-past-a-device": ({"n_layer": 2**50}, "more than any device holds (1 PiB)"),
    "width-past-a-device": (
        {"n_embd": 2**26},
        "n_embd vectors of its width alone (n_embd 67,108,864 x n_embd 67,108,864)",
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BAD_VALUES)
def test_a_config_value_no_model_is_built_from_is_refused_before_any_process(work, hermetic_home, case, command):
    overrides, needle = BAD_VALUES[case]
    model = str(write_model_dir(work.parent / "model", **overrides))
    name, *args = COMMANDS[command]
    with Unchanged(work, hermetic_home):
        refused(invoke(name, "--model", model, *args), needle)


def test_the_values_are_checked_where_the_config_is_read(tmp_path):
    with pytest.raises(BadInput, match="has n_positions 0"):
        resolve_model(str(write_model_dir(tmp_path / "a", n_positions=0)))
    # null is the library's default, as an absent key is (GPT-2's own config.json has n_inner null).
    spec = resolve_model(str(write_model_dir(tmp_path / "b", n_inner=None, num_key_value_heads=None)))
    spec.check_usable(budget_bytes=2**30)
    # A position table within what a device holds is refused only against a budget, as the embedding is.
    spec = resolve_model(str(write_model_dir(tmp_path / "c", n_positions=10**9)))  # 128 GB at 2 bytes a weight
    spec.check_usable()
    with pytest.raises(BadInput, match="its position table alone .* more than the --gpu-budget 64.00 GiB"):
        spec.check_usable(budget_bytes=64 * 2**30)
    assert 10**9 * 64 * 2 < MAX_DEVICE_BYTES


def test_a_rotary_models_positions_are_not_a_table(tmp_path):
    """Llama-family positions are rotary (nothing of that size is allocated): only a device's bound holds."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 10**9,
    }
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    resolve_model(str(tmp_path / "llama")).check_usable(budget_bytes=2**30)


@pytest.mark.parametrize("command", COMMANDS)
def test_num_labels_go_through_the_same_bounds_as_the_vocabulary(work, hermetic_home, command):
    model = str(write_model_dir(work.parent / "cls", architectures=["GPT2ForSequenceClassification"]))
    name, *args = COMMANDS[command]
    with Unchanged(work, hermetic_home):
        refused(
            invoke(name, "--model", model, *args, "--num-labels", str(10**12)),
            "its classification head alone (--num-labels 1,000,000,000,000 x n_embd 64) needs at least",
        )


def test_a_model_name_too_long_for_the_file_system_is_one_line(work, hermetic_home):
    with Unchanged(work, hermetic_home):
        refused(invoke(*COMMANDS["estimate"], "--model", "x" * 5000), "cannot be a model: File name too long")


# -- 6. numbers: finite, and bounded by what the machine and clock can represent --------------------

NUMBERS = {
    "warmup-1e20": (["--warmup-steps", str(10**20)], f"--warmup-steps must be a whole number from 1 to {MAX_STEPS}"),
    "measure-int64": (
        ["--measure-steps", str(INT64_MAX)],
        f"--measure-steps must be a whole number from 1 to {MAX_STEPS}",
    ),
    "measure-text": (["--measure-steps", "1e3"], "--measure-steps '1e3' is not a whole number"),
    "timeout-1e20": (["--probe-timeout", str(10**20)], f"is too long; durations go up to {MAX_SECONDS} s"),
    "timeout-inf": (["--probe-timeout", "9" * 400], "is too long; durations go up to"),
    "compile-nan": (["--max-compile-seconds", "nan"], "--max-compile-seconds: cannot read 'nan' as a duration"),
    "compile-inf": (["--max-compile-seconds", "1e309"], "--max-compile-seconds: cannot read '1e309' as a duration"),
    "measure-seconds-negative": (["--measure-seconds", "-1"], "--measure-seconds: cannot read '-1' as a duration"),
    "generation-0": (
        ["--generation-max-length", "0"],
        "--generation-max-length must be a whole number of at least 1 (got 0)",
    ),
    "length-past-64-bits": (
        ["--target-length", str(2**63)],
        f"--target-length must be a whole number from 1 to {INT64_MAX}",
    ),
    "lora-dropout-nan": (["--peft", "lora", "--lora-dropout", "nan"], "--lora-dropout 'nan' is not a finite number"),
    "rendezvous-port-0": (
        ["--gpus", "2", "--nodes", "2", "--rendezvous", "host:0"],
        "--rendezvous 'host:0' is not HOST:PORT with a port from 1 to 65535",
    ),
    "rendezvous-port-99999": (
        ["--gpus", "2", "--nodes", "2", "--rendezvous", "host:99999"],
        "--rendezvous 'host:99999' is not HOST:PORT",
    ),
}


@pytest.mark.parametrize("case", NUMBERS)
@pytest.mark.parametrize("command", ["search", "probe"])
def test_a_number_past_its_bound_is_refused_where_click_reads_it(work, hermetic_home, model, command, case):
    flags, needle = NUMBERS[case]
    if command == "probe" and flags[0] == "--generation-max-length":
        flags = ["--task", "seq2seq", *flags]
    with Unchanged(work, hermetic_home):
        refused(invoke(*COMMANDS[command], "--model", model, *flags), needle)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--predict-margin", "nan"], "--predict-margin 'nan' is not a finite number"),
        (["--heartbeat", "inf"], "--heartbeat: cannot read 'inf' as a duration"),
        (["--timeout", "99999999h"], "--timeout: '99999999h' is too long"),
        (["--max-trials", str(10**20)], f"--max-trials must be a whole number from 1 to {INT64_MAX}"),
        (["--effective-batch", str(10**20)], "--effective-batch must be a whole number from 1 to"),
    ],
)
def test_search_flags_past_their_bound(work, hermetic_home, model, flags, needle):
    with Unchanged(work, hermetic_home):
        refused(invoke(*COMMANDS["search"], "--model", model, *flags), needle)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--epochs", "1e308"], f"--epochs must be at most {MAX_STEPS}"),
        (["--epochs", "nan"], "--epochs 'nan' is not a finite number"),
        (["--epochs", "0"], "--epochs must be above 0 (got '0')"),
        (["--learning-rate", "inf"], "--learning-rate 'inf' is not a finite number"),
        (["--max-steps", str(2**63)], f"--max-steps must be a whole number from 1 to {MAX_STEPS}"),
        (["--save-steps", "-1"], "--save-steps must be a whole number of at least 1 (got -1)"),
    ],
)
def test_train_flags_past_their_bound(work, hermetic_home, model, flags, needle):
    (work / "corpus.txt").write_text("hello world\n" * 50)
    with Unchanged(work, hermetic_home):
        refused(
            invoke(
                "train", "--model", model, "--gpu-budget", "1GiB", "--dataset", "corpus.txt", "--device", "cpu", *flags
            ),
            needle,
        )


@pytest.mark.parametrize(
    "stack, needle",
    [
        ("torch=1.10,torch=2.1", "--stack names torch more than once (torch=1.10,torch=2.1)"),
        ("torch=1.13, Torch=2.0,bitsandbytes=0.41.1", "--stack names torch more than once"),
        ("", "--stack is empty"),
        (" , ", "--stack is empty"),
    ],
)
def test_a_stack_names_each_library_once(work, hermetic_home, model, stack, needle):
    with Unchanged(work, hermetic_home):
        refused(invoke(*COMMANDS["estimate"], "--model", model, "--stack", stack), needle)


def test_one_bound_per_kind():
    assert MAX_STEPS == MAX_SECONDS * 10**6 and MAX_SECONDS == (2**31 - 1) // 1000
    for text in (float("inf"), float("nan"), 10**20, MAX_SECONDS + 1, "1" + "0" * 400):
        with pytest.raises(BadInput):
            parse_duration(text)
    assert parse_duration(MAX_SECONDS) == MAX_SECONDS and parse_duration("0", allow_zero=True) == 0
    with pytest.raises(BadInput, match="must be a positive duration"):
        parse_duration("0")
    ctx = click.Context(click.Command("x"))
    for text in ("1_000", "\uff11", "2.0", "1e3", " ", "9" * 5000, "-" + "9" * 5000):
        with pytest.raises(click.UsageError) as refused_:
            COUNT.convert(text, None, ctx)
        assert len(refused_.value.format_message()) < 200
    assert COUNT.convert(" 7 ", None, ctx) == 7 and COUNT.convert(str(INT64_MAX), None, ctx) == INT64_MAX
    with pytest.raises(click.UsageError, match=f"from 1 to {MAX_STEPS}"):
        STEPS.convert(str(MAX_STEPS + 1), None, ctx)
    assert WholeNumber(0, 5, "x").convert("0", None, ctx) == 0


# -- 7. ranks and rendezvous -------------------------------------------------------------------------


@pytest.fixture
def two_cores():
    with mock.patch("autotune.levers.sharding.os.cpu_count", return_value=2):
        yield


def test_cpu_ranks_follow_the_workers_rule(two_cores):
    assert most_cpu_ranks() == 2 and most_cpu_ranks(True) == 8
    assert cpu_rank_problems(2) == [] and cpu_rank_problems(8, oversubscribe=True) == []
    assert "give --gpus 2 or fewer, or --oversubscribe for up to 8" in cpu_rank_problems(3, oversubscribe=False)[0]
    assert "--oversubscribe" not in cpu_rank_problems(3)[0]  # (a command without the flag)


@pytest.mark.parametrize(
    "command, extra, needle",
    [
        (
            "probe",
            [],
            "--gpus 64 on the CPU starts 64 ranks on this machine, which has 2 cores for them to compute on; "
            "give --gpus 2 or fewer.",
        ),
        ("search", [], "give --gpus 2 or fewer, or --oversubscribe for up to 8"),
        ("search", ["--oversubscribe"], "give --gpus 8 or fewer."),
    ],
)
def test_more_cpu_ranks_than_cores_are_refused(work, hermetic_home, model, two_cores, command, extra, needle):
    with Unchanged(work, hermetic_home):
        refused(invoke(*COMMANDS[command], "--model", model, "--gpus", "64", *extra), needle)


def test_auto_without_cuda_counts_as_the_cpu(work, hermetic_home, model, two_cores):
    args = [a if a != "cpu" else "auto" for a in COMMANDS["probe"]]
    with Unchanged(work, hermetic_home):
        refused(invoke(*args, "--model", model, "--gpus", "3", env=NO_CUDA), "--gpus 3 on the CPU starts 3 ranks")


def test_several_nodes_take_no_workers(work, hermetic_home, model):
    with Unchanged(work, hermetic_home):
        refused(
            invoke(
                *COMMANDS["search"],
                "--model",
                model,
                "--nodes",
                "2",
                "--workers",
                "2",
                "--rendezvous",
                "127.0.0.1:29500",
            ),
            "--workers 2 with --nodes 2: a search on several nodes",
        )


NODE = ["node", "--rendezvous", "127.0.0.1:29500", "--nodes", "2", "--node-rank", "1"]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--device", "cuda"], "--device cuda: no CUDA device can be seen here"),
        (["--device", "cuda:0"], "--device cuda:0: no CUDA device can be seen here"),
        (["--device", "gpu0"], "--device 'gpu0' is not supported; use auto, cpu, cuda or cuda:N"),
        (["--device", "cpu", "--gpus", "64"], "--gpus 64 on the CPU starts 64 ranks"),
        (["--device", "cpu", "--rendezvous", "host:0"], "--rendezvous 'host:0' is not HOST:PORT"),
        (["--device", "cpu", "--rounds", str(10**20)], "--rounds must be a whole number from 1 to"),
    ],
)
def test_node_refuses_before_waiting_for_rounds(work, hermetic_home, two_cores, flags, needle):
    with (
        mock.patch("autotune.probe.node.serve_node", side_effect=AssertionError("waited for rounds")),
        Unchanged(work, hermetic_home),
    ):
        refused(invoke(*NODE, *flags, env=NO_CUDA), needle)


@pytest.mark.parametrize("address", ["10.0.0.1:29500", "[::1]:29500", "node-0.cluster.local:1", "h:65535"])
def test_a_rendezvous_of_host_and_port_is_taken(address):
    with mock.patch("autotune.probe.node.serve_node") as serve:
        outcome = invoke(*[a if a != "127.0.0.1:29500" else address for a in NODE], "--device", "cpu")
    assert outcome.returncode == 0, outcome.stderr
    assert serve.call_args.args[0] == address


# -- 10. worker checks what search checks, with the same code, before the study ---------------------

WORKER_MISTAKES = [
    (["--max-trials", "-1"], "--max-trials must be a whole number of at least 1 (got -1)"),
    (["--patience", "-1"], "--patience must be a whole number of at least 1 (got -1)"),
    (["--device", "gpu0"], "--device 'gpu0' is not supported"),
    (["--device", "cuda"], "--device cuda: no CUDA device can be seen here"),
    (["--timeout", "0"], "--timeout: '0' must be a positive duration"),
    (["--probe-timeout", str(10**20)], "--probe-timeout: '100000000000000000000' is too long"),
]


@pytest.mark.parametrize("flags, needle", WORKER_MISTAKES)
def test_worker_refuses_as_search_does_before_looking_at_the_study(work, hermetic_home, model, flags, needle):
    with (
        mock.patch("autotune.search.join_study", side_effect=AssertionError("looked at the study")),
        Unchanged(work, hermetic_home),
    ):
        joined = invoke("worker", "--study", "s1", *flags, env=NO_CUDA)
        searched = invoke(*COMMANDS["search"], "--model", model, *flags, env=NO_CUDA)
    refused(joined, needle)
    refused(searched, needle)
    message = lambda outcome: outcome.stderr.split(" (see: ")[0]
    assert message(joined) == message(searched)


@pytest.mark.parametrize(
    "args",
    [
        [*COMMANDS["estimate"], "--gpus", str(10**18)],
        [*COMMANDS["estimate"], "--gpus", str(2**16), "--nodes", str(2**16)],
        [*NODE[:4], str(2**16), "--node-rank", "1", "--gpus", str(2**16), "--device", "auto"],
    ],
)
def test_ranks_past_what_torch_distributed_numbers_are_refused_before_any_trace(work, hermetic_home, model, args):
    """(The estimator traced 10**18 ranks in a process and failed there; 2**31 - 1 ranks killed it for memory.)"""
    if args[0] != "node":
        args = [*args, "--model", model]
    with (
        mock.patch("autotune.probe.node.serve_node", side_effect=AssertionError("waited for rounds")),
        Unchanged(work, hermetic_home),
    ):
        refused(invoke(*args), "--gpus x --nodes must be at most 2147483647, the most ranks torch.distributed numbers")
