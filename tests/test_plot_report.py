"""`autotune plot` and `autotune report` over a study filled without probes: the figure's data
(frontier, OOMs, skips, pick), the PNG, the Markdown, and the one-line errors."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.cli.app import main
from autotune.render.plot import MATPLOTLIB_MISSING, Point, frontier, plot_points
from autotune.vocabulary.status import SettleHow
from autotune.store import open_store
from tests.helpers.store import ENV, GiB, config, make_study, result
from tests.helpers.cli import heavy_modules_loaded

# (micro_batch, checkpointing, status, tokens/s, peak reserved, predicted need)
PROBES = [
    (1, False, "ok", 900.0, 2 * GiB, None),
    (1, True, "ok", 700.0, 2 * GiB + GiB // 5, None),  # dominated: mb1 without checkpointing is faster in less
    (2, True, "ok", 1200.0, 5 * GiB // 2, None),
    (2, False, "ok", 1600.0, 3 * GiB, None),
    (4, True, "ok", 2000.0, 4 * GiB, None),
    (4, False, "ok", 2500.0, 5 * GiB, None),  # the pick
    (8, True, "ok", 2400.0, 6 * GiB, None),  # dominated by the pick
    (8, False, "oom", None, 7 * GiB, 9 * GiB),
    (16, True, "oom", None, None, None),  # no memory figure: not drawn
]
PICK = "mb4x8 blk512 fp32 no-ckpt sdpa"


@pytest.fixture
def study_db(tmp_path):
    """Study 'plotted' (budget 8 GiB): seven configs that fit, two OOMs, a config reused from an
    earlier study and a structural skip with a predicted need."""
    db = str(tmp_path / "results.db")
    with open_store(db) as store:
        study = make_study(store, "plotted")
        for mb, ckpt, status, speed, peak, predicted in PROBES:
            store.record_probe(
                study.id,
                config(mb, checkpointing=ckpt),
                result(status, speed, peak),
                env_fingerprint=ENV.fingerprint(),
                predicted_peak_bytes=predicted,
            )
        settle = dict(worker="w0", env_fingerprint=ENV.fingerprint(), how=SettleHow.UNCLAIMED)
        store.claims.settle(study.id, config(1, precision="bf16"), result("ok", 850.0, GiB + GiB // 2), **settle)
        store.claims.settle(
            study.id,
            config(16, checkpointing=False),
            result("skipped", None, None, error="an OOM rules it out"),
            predicted_peak_bytes=17 * GiB,
            cacheable=False,
            **settle,
        )
    return db


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def stored(db: str):
    with open_store(db, read_only=True) as store:
        return store.study("plotted"), store.probes("plotted")


def test_plot_points_frontier_is_monotone_keeps_the_pick_and_drops_the_dominated(study_db):
    study, probes = stored(study_db)
    data = plot_points(probes, budget_bytes=study.budget_bytes, margin_bytes=study.margin_bytes)
    labels = [p.label for p in data.frontier]
    assert data.pick is not None and data.pick.label == PICK and PICK in labels
    xs, ys = [p.required_bytes for p in data.frontier], [p.tokens_per_s for p in data.frontier]
    assert xs == sorted(xs) and ys == sorted(ys) and len(set(ys)) == len(ys)
    assert "mb1x32 blk512 fp32 ckpt sdpa" not in labels and "mb8x4 blk512 fp32 ckpt sdpa" not in labels
    assert len(data.fits) == 8 and [label.split()[0] + label.split()[2] + label.split()[3] for label in labels] == [
        "mb1x32bf16no-ckpt",
        "mb1x32fp32no-ckpt",
        "mb2x16fp32ckpt",
        "mb2x16fp32no-ckpt",
        "mb4x8fp32ckpt",
        "mb4x8fp32no-ckpt",
    ]
    # The OOM sits at its predicted need, not where it failed; the skip at its prediction.
    assert [(p.required_bytes, p.predicted) for p in data.oom] == [(9 * GiB, True)]
    assert [p.required_bytes for p in data.skipped] == [17 * GiB]
    assert data.unplaced == {"oom": 1} and data.limit_bytes == 8 * GiB - GiB // 4
    # A pick chosen elsewhere (a confirmation round's tie) is the one marked.
    other = plot_points(probes, budget_bytes=8 * GiB, margin_bytes=0, pick_key=config(4, checkpointing=True).key())
    assert other.pick is not None and other.pick.label == "mb4x8 blk512 fp32 ckpt sdpa"


def test_frontier_of_nothing_and_of_ties():
    def point(name: str, gib: int, speed: float) -> Point:
        return Point(name, name, "ok", "fp32", False, gib * GiB, speed)

    assert frontier([]) == []
    # Same memory: the faster only; same speed for more memory: not on it.
    points = [point("a", 2, 100.0), point("b", 2, 150.0), point("c", 3, 150.0), point("d", 4, 151.0)]
    assert [p.label for p in frontier(points)] == ["b", "d"]


def test_plot_writes_a_png(study_db, tmp_path):
    out = tmp_path / "figs" / "study.png"
    out.parent.mkdir()  # (a missing folder is refused, not made: tests/test_bad_input_round3.py)
    proc = invoke("plot", "--db", study_db, "--out", str(out))
    assert proc.exit_code == 0 and proc.output.strip() == f"wrote {out}"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 300_000


def test_plot_defaults_to_the_study_name_here(study_db, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("plot", "--db", study_db).exit_code == 0
    assert (tmp_path / "plotted.png").read_bytes()[:4] == b"\x89PNG"


def _main(capsys, *args: str) -> tuple[int, str, str]:
    sys.argv = ["autotune", *args]
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def test_plot_without_matplotlib_is_one_line_exit_2(study_db, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _main(capsys, "plot", "--db", study_db, "--out", str(tmp_path / "x.png"))
    assert (code, out) == (2, "")
    assert err == f"autotune: error: {MATPLOTLIB_MISSING}\n"
    assert MATPLOTLIB_MISSING == "autotune plot needs matplotlib: pip install 'autotune[plot]'"
    assert not (tmp_path / "x.png").exists()


def test_unknown_study_and_unknown_suffix_are_one_line_exit_2(study_db, tmp_path, monkeypatch, capsys):
    for command in ("plot", "report"):
        code, out, err = _main(capsys, command, "--db", study_db, "--study", "nope")
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and "no study named 'nope'" in err
    code, _, err = _main(capsys, "plot", "--db", study_db, "--out", str(tmp_path / "x.gif"))
    assert (
        code == 2 and err.startswith("autotune: error: --out: cannot draw a .gif file") and len(err.splitlines()) == 1
    )


def test_report_markdown_has_the_setup_table_pick_counts_and_image(study_db, tmp_path):
    out = tmp_path / "report" / "study.md"
    out.parent.mkdir()
    assert invoke("report", "--db", study_db, "--out", str(out)).exit_code == 0
    text = out.read_text()
    assert "| rank | config | tokens/s | step s | peak reserved | needs | of the budget |" in text
    assert f"| 1 | `{PICK}` | 2,500 |" in text
    assert f"Chosen: {PICK}" in text and "runner-up: mb8x4 blk512 fp32 ckpt sdpa, 1.04x slower" in text
    assert "torch 2.13.0, transformers 5.23.0" in text and "budget**: 8.00 GiB" in text
    assert (
        "11 configurations: 9 probed, 1 reused from earlier studies, 1 skipped without a probe. "
        "8 fit, 2 ran out of memory, 1 skipped."
    ) in text
    assert "![plotted: tokens/s against memory needed](study.png)" in text
    assert (out.parent / "study.png").read_bytes()[:4] == b"\x89PNG"


def test_report_to_stdout_without_matplotlib_says_so(study_db, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    proc = invoke("report", "--db", study_db, "--plot", str(tmp_path / "p.png"))
    assert proc.exit_code == 0 and proc.output.startswith("## autotune: `gpt2` under 8.00 GiB")
    assert f"(No plot: {MATPLOTLIB_MISSING}.)" in proc.output and "![" not in proc.output
    assert not (tmp_path / "p.png").exists()
    assert "(No plot: pass `--plot FILE.png` to draw one.)" in invoke("report", "--db", study_db).output


def test_plot_and_report_import_no_torch(study_db, tmp_path):
    # One process for both: `report --plot` draws with autotune.render.plot as `plot` does.
    loaded = heavy_modules_loaded(
        "report", "--db", study_db, "--out", str(tmp_path / "r.md"), "--plot", str(tmp_path / "r.png")
    )
    assert loaded == ["sqlalchemy"] and (tmp_path / "r.png").exists()


def test_every_contender_is_labelled_clear_of_the_others_with_its_spread_as_an_error_bar(
    study_db, tmp_path, monkeypatch
):
    """The pick and its three fastest rivals each get a label, none of which covers another label or
    a point; each throughput carries its stored spread as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autotune.render import plot

    study, probes = stored(study_db)
    probes = [replace_result(p, step_spread=0.08) if p.result.status == "ok" else p for p in probes]
    data = plot_points(probes, budget_bytes=study.budget_bytes, margin_bytes=study.margin_bytes)
    assert data.pick is not None and data.pick.label == PICK
    assert [p.label for p in data.contenders] == [
        "mb8x4 blk512 fp32 ckpt sdpa",
        "mb4x8 blk512 fp32 ckpt sdpa",
        "mb2x16 blk512 fp32 no-ckpt sdpa",
    ]
    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))
    plot.write_plot(data, "title", tmp_path / "contenders.png")
    ax = drawn[0].axes[0]
    renderer = drawn[0].canvas.get_renderer()
    notes = [child for child in ax.get_children() if isinstance(child, matplotlib.text.Annotation)]
    assert len(notes) == 4 and notes[0].get_text().startswith(f"pick: {PICK}")
    boxes = [note.get_window_extent(renderer) for note in notes]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    points = [ax.transData.transform(((p.required_bytes or 0) / 2**30, p.tokens_per_s)) for p in data.fits]
    assert not any(box.contains(x, y) for box in boxes for x, y in points)
    bars = [c for c in ax.containers if isinstance(c, matplotlib.container.ErrorbarContainer)]
    heights = sorted(round(seg[1][1] - seg[0][1]) for bar in bars for seg in bar.lines[2][0].get_segments())
    assert heights and heights[-1] == round(2 * 0.08 * 2500)  # the pick's: ±8% of 2,500 tokens/s


def replace_result(probe, **changes):
    from dataclasses import replace

    return replace(probe, result=replace(probe.result, **changes))


def test_a_plans_configs_predicted_not_to_fit_are_drawn_as_predicted_not_as_oom(tmp_path, monkeypatch):
    import dataclasses

    import autotune.render.plot as plot
    from autotune.specs.cards import find_card
    from autotune.levers.config import ProbeConfig
    from autotune.planner import Plan, Planned, Target
    from autotune.planner.card_speed import SpeedPrediction
    from tests.helpers.fakes import fake_estimate as _estimate

    target = Target.of(find_card("h100"), 8 * GiB, 0.05)
    speed = SpeedPrediction(0.1, 40_000.0, 0.1, 0.0, 0.0, 0.0, 0.5, 1e15, 1e14, 1e9)
    fits = Planned(
        ProbeConfig("gpt2", 4, 512), _estimate(ProbeConfig("gpt2", 4, 512), 5 * GiB), True, fits=True, speed=speed
    )
    over = Planned(
        ProbeConfig("gpt2", 8, 512),
        _estimate(ProbeConfig("gpt2", 8, 512), 12 * GiB),
        True,
        fits=False,
        speed=dataclasses.replace(speed, tokens_per_s=50_000.0),
    )
    drawn = {}
    monkeypatch.setattr(plot, "write_plot", lambda data, title, path: drawn.setdefault("data", data) and path)
    save = plot.save_plan_plot
    save(Plan("gpt2", target, None, [fits, over]), tmp_path / "plan.png")
    data = drawn["data"]
    assert (
        not data.oom and [p.label for p in data.over] == ["mb8x1 blk512 fp32 no-ckpt sdpa"] and data.over[0].predicted
    )
    assert data.pick is not None and data.pick.label == "mb4x1 blk512 fp32 no-ckpt sdpa"


def test_an_oom_is_said_whole_and_a_probe_that_ran_out_has_no_headroom():
    from autotune.levers.config import ProbeConfig
    from autotune.render.tables import error_gist, format_probe_result
    from autotune.results.probe_result import ProbeResult

    cpu = (
        "torch.OutOfMemoryError: CPU budget emulation: out of memory. Tried to allocate 102928384 bytes with "
        "700000000 bytes in use of a 796917760-byte cap."
    )
    cuda = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79 GiB"
    )
    assert error_gist(cpu) == "out of memory: tried to allocate 98.16 MiB more"
    assert error_gist(cuda) == "out of memory: tried to allocate 20.00 MiB more"
    long = "RuntimeError: " + "word " * 30
    assert len(error_gist(long)) <= 80 and error_gist(long).endswith("…") and not error_gist(long)[:-1].endswith("wor")
    oom = ProbeResult(
        status="oom",
        budget_bytes=800 * 2**20,
        margin_bytes=40 * 2**20,
        cap_bytes=760 * 2**20,
        peak_reserved_bytes=728 * 2**20,
        peak_allocated_bytes=700 * 2**20,
        context_bytes=0,
        error=cpu,
    )
    text = format_probe_result(ProbeConfig("gpt2", 8, 64), oom)
    assert "headroom" not in text and "needs more than the 760.00 MiB the budget leaves it" in text
