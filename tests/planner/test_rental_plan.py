"""Which card to rent, how many, how long, how much (`plan --gpu A,B --gpus 1,2 --tokens N`): the
price files as published (SkyPilot's catalog, a plain table), every card and count weighed from one
trace per count, the run's time and cost worked out from the figures shown, the cheapest, fastest
and Pareto front named, and each mistake one line with exit status 2."""

from __future__ import annotations

import json

import pytest

from autotune.planner.prices import read_prices
from autotune.render.live import PROGRESS_ENV, read_progress
from autotune.specs.cards import find_card
from autotune.vocabulary.errors import BadInput
from tests.helpers.cli import Unchanged, assert_usage_error, invoke

# SkyPilot's catalog rows as its vms.csv files have them (columns in one cloud's order; the H100's
# two boards under one accelerator name, a CPU instance, a TPU, a region cheaper than another).
SKYPILOT = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice
cpu_4x_general,,,4.0,16.0,0.2,us-east-1,,
gpu_1x_h100_sxm5,H100,1.0,26.0,225.0,3.29,us-east-1,"{'Gpus': [{'Name': 'H100'}]}",
gpu_1x_h100_sxm5,H100,1.0,26.0,225.0,2.99,us-west-1,"{'Gpus': [{'Name': 'H100'}]}",1.50
gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,23.92,us-east-1,,
gpu_1x_h100_pcie,H100,1.0,26.0,200.0,2.49,us-east-1,,
gpu_1x_a100,A100,1.0,30.0,200.0,1.29,us-east-1,,
tpu-v5e-8,tpuv5e,8.0,,,9.6,us-east-1,,
"""


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_skypilots_catalog_gives_the_cheapest_offer_of_each_card_and_count(tmp_path):
    book = read_prices(write(tmp_path, "vms.csv", SKYPILOT))
    h100, pcie, a100_40 = find_card("h100"), find_card("h100-pcie"), find_card("a100-40gb")
    one = book.offer(h100, 1)
    assert (one.per_gpu_hour, one.spot_per_gpu_hour) == (2.99, 1.50) and "us-west-1" in one.source
    assert book.offer(h100, 8).per_gpu_hour == pytest.approx(23.92 / 8)
    assert book.offer(h100, 2) is None  # (sold in ones and eights: no price invented for two)
    assert book.offer(pcie, 1).per_gpu_hour == 2.49  # (the instance type names the PCIe board)
    assert book.offer(a100_40, 1).per_gpu_hour == 1.29  # (SkyPilot's "A100" is the 40 GB board)
    assert book.offer(find_card("a100"), 1) is None
    assert book.passed_over == {"tpuv5e": 1}


def test_a_plain_table_prices_any_count_and_the_shipped_table_names_its_sources():
    book = read_prices()
    assert book.offer(find_card("h100"), 8).per_gpu_hour == pytest.approx(2.99)
    assert book.offer(find_card("l4"), 1) is None  # (no source: time only)
    text = (read_prices.__globals__["DEFAULT_PRICES"]).read_text()
    assert "Date: 2026-12-01" in text and "skypilot-catalog/blob/" in text


def test_a_plain_table(tmp_path):
    path = write(tmp_path, "p.csv", "card,price_per_gpu_hour,spot_per_gpu_hour\nl4,0.80,0.31\nH100,2.50,\n")
    book = read_prices(path)
    assert book.offer(find_card("l4"), 4).per_gpu_hour == 0.80 and book.offer(find_card("l4"), 4).spot_per_gpu_hour
    assert book.offer(find_card("h100"), 1).spot_per_gpu_hour is None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("name,cost\nh100,2\n", "no column AcceleratorName, AcceleratorCount, Price) or a table of card"),
        ("card,price\nh100,2\n", "(no column price_per_gpu_hour)"),
        ("card,price_per_gpu_hour\nh100,-2\n", "row 2: price_per_gpu_hour '-2' is not a price"),
        ("card,price_per_gpu_hour\nh100,two\n", "row 2: price_per_gpu_hour 'two' is not a number"),
        ("card,price_per_gpu_hour\nh100,nan\n", "is not a price"),
        ("card,price_per_gpu_hour\nh10,2\n", "row 2: 'h10' is unknown"),
        ("InstanceType,AcceleratorName,AcceleratorCount,Price\nx,H100,1,-1\n", "row 2: Price '-1' is not a price"),
    ],
)
def test_a_price_file_of_another_shape_or_a_bad_price_is_one_line(tmp_path, text, needle):
    with pytest.raises(BadInput, match=None) as refused:
        read_prices(write(tmp_path, "bad.csv", text))
    assert needle in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--gpu", "h100,h10", "--tokens", "1M"], "--gpu 'h10' is unknown; the cards it knows, nearest first: h100,"),
        (["--gpu", "h100,l4", "--tokens", "0"], "--tokens '0': a run trains at least one token"),
        (["--gpu", "h100,l4", "--tokens", "lots"], "--tokens 'lots' is not a count of tokens"),
        (["--gpu", "h100,l4"], "give its size with --tokens N"),
        (["--gpu", "h100", "--gpus", "1,0", "--tokens", "1M"], "--gpus: 0 is below 1"),
        (["--gpu", "h100,l4", "--tokens", "1M", "--gpu-budget", "8GiB"], "--gpu-budget goes with one card"),
        (["--gpu", "h100", "--prices", "p.csv"], "--prices goes with --tokens N"),
        (["--gpu", "h100,l4", "--tokens", "1M", "--prices", "missing.csv"], "missing.csv: no such file"),
        (["--gpu", "h100,l4", "--tokens", "1M", "--prices", "bad.csv"], "(no column price_per_gpu_hour)"),
        (["--gpu", "h100,l4", "--tokens", "1M", "--prices", "negative.csv"], "is not a price"),
        (["--gpu", "h100,l4", "--tokens", "1M", "--plot", "x.html"], "the rental plot is drawn as an image"),
        (["--gpu", "h100,l4", "--tokens", "1M", "--top", "3"], "--top goes with one card and one count"),
    ],
)
def test_mistakes_are_one_line_exit_2_and_nothing_written(tmp_path, hermetic_home, tiny_model, extra, needle):
    write(tmp_path, "bad.csv", "card,price\nh100,2\n")
    write(tmp_path, "negative.csv", "card,price_per_gpu_hour\nh100,-3\n")
    extra = [str(tmp_path / e) if e.endswith(".csv") else e for e in extra]
    with Unchanged(hermetic_home):
        assert_usage_error(invoke("plan", "--model", tiny_model, *extra), needle)


@pytest.mark.slow  # (traces a tiny GPT-2: two counts, once each for three cards)
def test_every_card_and_count_is_weighed_from_one_trace_per_count(tmp_path, hermetic_home, tiny_model):
    prices = write(tmp_path, "p.csv", "card,price_per_gpu_hour,spot_per_gpu_hour\nh100,3.00,1.00\nl4,0.80,\n")
    space = ["--micro-batches", "1,2", "--block-sizes", "64", "--precisions", "bf16", "--attention", "sdpa"]
    space += ["--checkpointing", "off"]
    args = ["plan", "--model", tiny_model, "--gpu", "h100,l4,a10", "--gpus", "1,2", "--tokens", "50M", *space]
    args += ["--strategies", "ddp"]
    done = invoke(*args, "--prices", str(prices), "--json", "--no-cache", env={PROGRESS_ENV: "1"})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    # The progress the service's page draws, over both counts: the count only grows, the total (the
    # plan's most traces) only shrinks, and they meet at the traces the plan made.
    progress = [p for line in done.stderr.splitlines() if (p := read_progress(line)) is not None]
    assert progress and all(traced <= of for traced, of in progress)
    assert [traced for traced, _ in progress] == sorted(traced for traced, _ in progress)
    assert [of for _, of in progress] == sorted((of for _, of in progress), reverse=True)
    assert progress[-1][0] == progress[-1][1] >= plan["traces"]
    options = {(o["card"], o["gpus"]): o for o in plan["options"]}
    assert set(options) == {(c, n) for c in ("h100", "l4", "a10") for n in (1, 2)}
    # Traced once per count for all three cards: as many traces as one card's plan of the same space.
    one = invoke("plan", "--model", tiny_model, "--gpu", "h100", "--json", "--no-cache", *space, "--gpus", "1")
    assert one.returncode == 0, one.stderr
    single = json.loads(one.stdout)
    assert 0 < plan["traces"] <= 2 * single["traces"]
    for option in options.values():
        assert option["fits"] and option["seconds"] == pytest.approx(50e6 / option["tokens_per_s"])
        if option["per_gpu_hour"] is not None:
            assert option["cost"] == pytest.approx(option["seconds"] / 3600 * option["gpus"] * option["per_gpu_hour"])
    assert options[("a10", 1)]["cost"] is None and options[("h100", 2)]["spot_cost"] == pytest.approx(
        options[("h100", 2)]["seconds"] / 3600 * 2 * 1.00
    )
    # The one-card plan's best config on the h100 is this plan's h100 x1 row, at the same speed.
    best = next(c for c in single["candidates"] if c["fits"])
    assert options[("h100", 1)]["config"] == best["label"]
    assert options[("h100", 1)]["tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    # Sorted by cost (the priced first), cheapest and fastest named, the front undominated.
    costs = [o["cost"] for o in plan["options"] if o["cost"] is not None]
    assert costs == sorted(costs) and plan["options"][0]["cost"] == costs[0]
    assert tuple(plan["cheapest"]) == (plan["options"][0]["card"], plan["options"][0]["gpus"])
    assert "cheapest" in plan["options"][0]["marks"]  # (each option's marks, as the table says them)
    fastest = min(options.values(), key=lambda o: o["seconds"])
    assert tuple(plan["fastest"]) == (fastest["card"], fastest["gpus"])
    priced = [o for o in options.values() if o["cost"] is not None]
    for card, gpus in map(tuple, plan["front"]):
        member = options[(card, gpus)]
        assert not any(o["seconds"] < member["seconds"] and o["cost"] < member["cost"] for o in priced)
    assert all(
        tuple(k) in map(tuple, plan["front"])
        for k, o in options.items()
        if o["cost"] is not None
        and not any(p["seconds"] <= o["seconds"] and p["cost"] <= o["cost"] and p is not o for p in priced)
    )
    # The same as CSV for a pipeline, and as a table for people.
    table = invoke(*args, "--prices", str(prices), "--sort", "time", "--plot", str(tmp_path / "rent.png"))
    assert table.returncode == 0 and "cheapest:" in table.stdout and "fastest:" in table.stdout
    assert (tmp_path / "rent.png").read_bytes().startswith(b"\x89PNG") and "wrote" in table.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # (no temporary file left)
    rows = invoke(*args, "--prices", str(prices), "--format", "csv").stdout.splitlines()
    assert rows[0].startswith("card,gpus,config,tokens_per_s,seconds") and len(rows) == 7


@pytest.mark.slow  # (a tiny GPT-2's space traced whole, then as far as each card's fastest fit needs)
def test_tracing_stops_once_each_cards_fastest_fit_is_known_and_finds_what_tracing_everything_does(
    tmp_path, hermetic_home, trace_children
):
    import dataclasses

    from autotune.planner.card_plan import Target, judge_plan, trace_fastest, trace_space
    from autotune.search.space import SearchSpace
    from autotune.specs.models import resolve_model
    from tests.helpers.models import write_model_dir

    spec = resolve_model(str(write_model_dir(tmp_path / "gpt2")))
    space = SearchSpace.build(
        spec,
        micro_batches=[1, 2, 4],
        block_sizes=[64],
        effective_batch=4,
        precisions=["bf16"],
        checkpointing=[False, True],
        attentions=["sdpa", "eager"],
    )
    cards = [find_card(name) for name in ("h100", "l4", "a10")]
    # (each config traced once, by the first call; the later ones are answered from `memo` and say
    # which configs they needed)
    common = dict(timeout=120.0, use_cache=False, children=trace_children, memo={})
    whole = trace_space(space, [Target.of(card, None, 0) for card in cards], **common)
    # Budgets that cut the space at different places (with each card's context): the fastest fit
    # differs from card to card. (A card where only the smallest need fits has the slowest config as
    # its answer: every faster group is traced to rule it out, as the last assertion shows.)
    needs = sorted(e.reserved_bytes for e in whole.estimates.values())
    context = next(iter(whole.estimates.values())).context_bytes

    def budgeted(card, reserved: int) -> Target:
        return Target.of(card, reserved + (card.context_bytes or context), 0)

    cuts = (needs[-1], needs[len(needs) * 3 // 4], needs[len(needs) // 2])
    targets = [budgeted(card, need) for card, need in zip(cards, cuts)]
    bounded = trace_fastest(spec, space, targets, **common)
    assert 0 < len(bounded.traced) < len(whole.traced)
    for target in targets:
        everything = judge_plan(spec, space, target, whole, stack=None).best
        enough = judge_plan(spec, space, target, bounded, stack=None).best
        assert everything is not None and enough is not None, target.name
        assert enough.tokens_per_s == pytest.approx(everything.tokens_per_s, rel=1e-9), target.name
        assert enough.need_bytes <= target.budget.allowed_bytes
    # On a card nothing fits, every group is traced (its smallest need known) but eager attention's:
    # each SDPA twin needs no more memory and is predicted no slower, so an eager config is never a
    # card's fastest fit. Both held here, on every config and card.
    nothing = [budgeted(cards[0], needs[0] // 2)]
    sdpa_only = {key for key in whole.traced if whole.estimates[key].config.attention != "eager"}
    assert trace_fastest(spec, space, nothing, **common).traced == sdpa_only
    for target in targets:
        planned = {p.config.key(): p for p in judge_plan(spec, space, target, whole, stack=None).planned}
        for item in planned.values():
            if item.config.attention == "eager":
                twin = planned[dataclasses.replace(item.config, attention="sdpa").key()]
                assert twin.need_bytes <= item.need_bytes and twin.tokens_per_s >= item.tokens_per_s


@pytest.mark.slow  # (a tokenizer trained, the data counted, one tiny trace per count)
def test_a_run_of_epochs_over_a_dataset_is_its_counted_tokens_times_the_epochs(tmp_path, hermetic_home, tiny_model):
    from transformers import AutoTokenizer

    from tests.helpers.corpus import corpus_text, write_tokenizer

    text = corpus_text()
    write_tokenizer(text, tmp_path / "tok")
    rows = [paragraph for paragraph in text.split("\n\n") if paragraph.strip()][:300]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    space = ["--micro-batches", "2", "--block-sizes", "64", "--precisions", "bf16", "--attention", "sdpa"]
    space += ["--checkpointing", "off", "--tokenizer", str(tmp_path / "tok"), "--dataset", str(data)]
    done = invoke("plan", "--model", tiny_model, "--gpu", "h100,l4", "--epochs", "2.5", "--json", *space)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    counted = sum(len(ids) for ids in tokenizer(rows)["input_ids"])  # (packed: every row's tokens, end to end)
    assert plan["tokens"] == round(2.5 * counted)
    assert any(f"{counted:,} tokens each (300 examples)" in note for note in plan["notes"]), plan["notes"]
    for option in plan["options"]:
        assert option["seconds"] == pytest.approx(plan["tokens"] / option["tokens_per_s"])
    with Unchanged(hermetic_home):
        for extra, needle in (
            (["--epochs", "0"], "--epochs must be above 0 (got '0')"),  # (flags/values.PASSES, as train's)
            (["--epochs", "two"], "--epochs 'two' is not a finite number"),
            (["--epochs", "1", "--tokens", "1M"], "give the run's size once"),
        ):
            assert_usage_error(invoke("plan", "--model", tiny_model, "--gpu", "h100,l4", *space, *extra), needle)
        no_data = [a for a in space if a not in ("--dataset", str(data))]
        refused = invoke("plan", "--model", tiny_model, "--gpu", "h100,l4", *no_data, "--epochs", "1")
        assert_usage_error(refused, "--epochs counts passes over --dataset D")


@pytest.mark.slow  # (traces a tiny GPT-2 once, then plans it again from the cache)
def test_a_plan_answered_from_the_cache_starts_no_trace_child(hermetic_home, tiny_model, monkeypatch):
    """A trace child waits seconds for torch before it can answer (8 s of a 9 s cached plan on two
    cores): one is started only when a trace is wanted, so a plan the cache answers starts none and
    says the same."""
    from autotune.estimate.launch import TraceChild

    started: list[str | None] = []
    real_start = TraceChild.start

    def counted(self, *args, **kwargs):
        started.append(self.model_type)
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(TraceChild, "start", counted)
    space = ["--micro-batches", "1,2", "--block-sizes", "64", "--precisions", "bf16", "--attention", "sdpa"]
    args = ["plan", "--model", tiny_model, "--gpu", "h100,l4", "--gpus", "1,2", "--tokens", "1M", *space, "--json"]
    cold = invoke(*args)
    assert cold.returncode == 0, cold.stderr
    assert started and set(started) == {"gpt2"}  # (started on demand, still importing the model's code first)
    started.clear()
    warm = invoke(*args)
    assert warm.returncode == 0, warm.stderr
    assert started == []
    assert json.loads(warm.stdout)["options"] == json.loads(cold.stdout)["options"]
