"""Output that cannot be written (issue 48, class 1): standard output to a full device or a pipe
whose reader left, a --out that is a FIFO, a directory that takes no file, a disk that fills while
the file is written, plan --plot failing after its traces. Each is one line on stderr that names
the thing, exit status 2 (141 for a reader that left, as `cat` there), no traceback, and nothing
half-written left behind: no partial file, no temporary file, no cache entry. No probe, no trace:
studies are filled through the store, plan's traces are replaced."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli.app import main
from autotune.vocabulary.errors import EXIT_BROKEN_PIPE
from autotune.vocabulary.errors import BadInput
from autotune.host.output import Output, check_destination, stdout_fault, write_file
from autotune.store import open_store
from tests.helpers.cli import autotune, autotune_command
from tests.helpers.store import ENV, GiB, config, make_study, result

ENOSPC_LINE = "No space left on device (errno 28)"


@pytest.fixture
def study_db(hermetic_home) -> str:
    """The hermetic database ($AUTOTUNE_DB) with one study of three probes, so that `studies`,
    `plot` and `report` have something to write."""
    db = str(hermetic_home / "autotune.db")
    with open_store(db) as store:
        study = make_study(store, "written")
        for mb in (1, 2, 4):
            store.record_probe(
                study.id, config(mb), result("ok", 1000.0 * mb, mb * GiB), env_fingerprint=ENV.fingerprint()
            )
    return db


@pytest.fixture
def work(tmp_path) -> Path:
    """An empty directory to write in."""
    path = tmp_path / "work"
    path.mkdir()
    return path


def one_line(stderr: str, *needles: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    for needle in needles:
        assert needle in lines[0], stderr
    return lines[0]


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """main() in this process (so that a fault can be patched in): exit status, stdout, stderr."""
    sys.argv = ["autotune", *args]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def savefig_that_fills_the_disk(self, fname, *args, **kwargs):
    """matplotlib's savefig on a disk that fills half-way: some bytes written, then ENOSPC."""
    Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n half a figure")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# -- standard output -----------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_to_a_full_device_is_one_line_and_exit_2(study_db):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(autotune_command("studies"), stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    one_line(proc.stderr, "cannot write standard output", ENOSPC_LINE)


def test_stdout_to_a_pipe_whose_reader_left_ends_quietly_with_141(study_db):
    read_end, write_end = os.pipe()
    os.close(read_end)  # `autotune studies | head -0`: the reader is gone before the first line
    try:
        proc = subprocess.run(
            autotune_command("studies"), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (EXIT_BROKEN_PIPE, "")
    # The same command into a reader is unchanged.
    proc = autotune("studies", timeout=120)
    assert proc.returncode == 0 and "written" in proc.stdout


def test_an_oserror_that_is_not_stdouts_keeps_its_traceback():
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/some/other/file")
    except OSError as exc:
        assert not stdout_fault(exc)  # a file named: not stdout's
    try:
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
    except OSError as exc:
        assert not stdout_fault(exc)  # not a stream's error
    try:
        stream = sys.stdout  # (as click.echo holds it)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        assert stdout_fault(exc) and stream is sys.stdout


# -- a place no file can go: refused before any work, nothing created ----------------------------


def test_a_fifo_as_out_is_refused_at_once_not_waited_on(study_db, work):
    pytest.importorskip("matplotlib")
    fifo = work / "plot.png"
    os.mkfifo(fifo)
    for command in (["plot", "--out", str(fifo)], ["report", "--out", str(work / "r.md"), "--plot", str(fifo)]):
        proc = autotune(*command, timeout=60)  # (a write into the FIFO would block: the timeout fails the test)
        assert proc.returncode == 2, proc.stderr
        one_line(proc.stderr, str(fifo), "FIFO")
        assert sorted(p.name for p in work.iterdir()) == ["plot.png"]


def test_a_directory_that_takes_no_file_is_one_line_naming_the_file(study_db, capsys):
    pytest.importorskip("matplotlib")
    target = Path("/sys/autotune-test-plot.png")
    try:  # sysfs refuses new files, even to root (for whom chmod stops nothing)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(target)
        pytest.skip("/sys takes new files here")
    except OSError:
        pass
    code, out, err = run_main(capsys, "plot", "--out", str(target))
    assert (code, out) == (2, "")
    one_line(err, f"--out {target}: cannot write it", "(errno ")
    assert not target.exists()


def test_destination_checks_refuse_each_kind_of_non_file(work):
    os.mkfifo(work / "fifo.md")
    (work / "folder.md").mkdir()
    for path, needle in (
        (work / "fifo.md", "that is a FIFO"),
        (work / "folder.md", "that is a directory"),
        (Path("/dev/null"), "that is a character device"),
        (work / "missing" / "r.md", f"the directory {work / 'missing'} does not exist"),
    ):
        with pytest.raises(BadInput) as refused:
            check_destination(path, "--out")
        assert str(refused.value).startswith(f"--out {path}: ") and needle in str(refused.value)
    assert not (work / "missing").exists()


# -- a disk that fills while writing: one line naming the file, nothing left ----------------------


def test_report_out_on_a_full_disk_leaves_neither_report_nor_plot_nor_temporary(study_db, work, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import autotune.host.output

    monkeypatch.setattr(autotune.host.output.os, "replace", no_space)
    code, out, err = run_main(capsys, "report", "--out", str(work / "r.md"))
    assert (code, out) == (2, "")
    one_line(err, str(work / "r."), ENOSPC_LINE, "free space there")
    assert list(work.iterdir()) == []


def test_plot_out_on_a_disk_that_fills_half_way_leaves_no_partial_file(study_db, work, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig_that_fills_the_disk)
    out_file = work / "plot.png"
    code, out, err = run_main(capsys, "plot", "--out", str(out_file))
    assert (code, out) == (2, "")
    one_line(err, f"--out {out_file}: cannot write it", ENOSPC_LINE)
    assert list(work.iterdir()) == [] and matplotlib is not None


def test_write_file_replaces_whole_keeps_permissions_and_writes_through_a_link(work):
    old = work / "r.md"
    old.write_text("old\n")
    os.chmod(old, 0o640)
    link = work / "link.md"
    link.symlink_to(old)
    assert write_file(link, "new\n") == link
    assert link.is_symlink() and old.read_text() == "new\n" and (old.stat().st_mode & 0o777) == 0o640
    with pytest.raises(BadInput):
        with Output(old) as out:
            out.write_text("half")
            out.fill(no_space)
    assert old.read_text() == "new\n" and sorted(p.name for p in work.iterdir()) == ["link.md", "r.md"]


# -- plan --plot: refused before the traces; a failure after them keeps none of their cache --------


def _fake_plan_for(calls: list):
    """plan_for without traces: caches one estimate, as the traces would, and returns a plan."""

    def plan_for(model, target, *args, use_cache=True, **kwargs):
        from autotune.levers.config import ProbeConfig
        from autotune.estimate.cache import EstimateCache
        from autotune.specs.models import resolve_model
        from autotune.planner import Plan, Planned
        from autotune.search.space import SearchSpace
        from autotune.planner.card_speed import SpeedPrediction
        from tests.helpers.fakes import fake_estimate as _estimate

        calls.append(model)
        chosen = ProbeConfig("gpt2", 4, 512)
        if use_cache:
            EstimateCache().put(f"key-{len(calls)}", _estimate(chosen, 5 * GiB))
        speed = SpeedPrediction(0.1, 40_000.0, 0.1, 0.0, 0.0, 0.0, 0.5, 1e15, 1e14, 1e9)
        space = SearchSpace.build(
            resolve_model("gpt2"),
            micro_batches=(4,),
            block_sizes=(512,),
            precisions=("fp32",),
            checkpointing=(False,),
            attentions=("sdpa",),
            effective_batch=4,
        )
        return Plan("gpt2", target, space, [Planned(chosen, _estimate(chosen, 5 * GiB), True, fits=True, speed=speed)])

    return plan_for


@pytest.mark.parametrize("earlier", (False, True), ids=("no-cache-yet", "earlier-estimates"))
def test_plan_plot_that_fails_after_the_traces_leaves_no_cache_and_no_file(
    hermetic_home, work, monkeypatch, capsys, earlier
):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    import autotune.planner
    from autotune.estimate.cache import EstimateCache

    cache = EstimateCache().path
    if earlier:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"version": 1, "entries": {"earlier": {"stored": 1.0, "estimate": {}}}}))
    before = cache.read_bytes() if earlier else None
    calls: list = []
    monkeypatch.setattr(autotune.planner, "plan_for", _fake_plan_for(calls))
    plot_file = work / "plan.png"
    with monkeypatch.context() as patch:
        patch.setattr(matplotlib.figure.Figure, "savefig", savefig_that_fills_the_disk)
        code, out, err = run_main(capsys, "plan", "--model", "gpt2", "--gpu", "h100", "--plot", str(plot_file))
    assert calls == ["gpt2"] and (code, out) == (2, "")
    one_line(err, f"--plot {plot_file}: cannot write it", ENOSPC_LINE)
    assert list(work.iterdir()) == []
    assert (cache.read_bytes() if cache.exists() else None) == before
    # Written whole, it keeps them: the cache is put back only when the plot fails.
    code, _, err = run_main(capsys, "plan", "--model", "gpt2", "--gpu", "h100", "--plot", str(plot_file))
    assert code == 0 and f"wrote {plot_file}" in err and plot_file.read_bytes()[:4] == b"\x89PNG"
    assert "key-2" in json.loads(cache.read_text())["entries"] and [p.name for p in work.iterdir()] == ["plan.png"]


def test_plan_plot_in_a_place_that_takes_no_file_is_refused_before_the_traces(hermetic_home, work, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import autotune.host.output
    import autotune.planner

    def refuse(path, *args, **kwargs):  # a directory that takes no new file (root writes anywhere chmod allows)
        if ".partial" in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    real_open = os.open
    calls: list = []
    monkeypatch.setattr(autotune.planner, "plan_for", _fake_plan_for(calls))
    plot_file = work / "plan.png"
    with monkeypatch.context() as patch:
        patch.setattr(autotune.host.output.os, "open", refuse)
        code, out, err = run_main(capsys, "plan", "--model", "gpt2", "--gpu", "h100", "--plot", str(plot_file))
    assert calls == [] and (code, out) == (2, "")
    one_line(err, f"--plot {plot_file}: cannot write it in {work}", "Permission denied (errno 13)")
    assert list(work.iterdir()) == [] and not (hermetic_home / "cache").exists()
