"""Multi-rank probes, done for real: two CPU ranks over gloo, started by torchrun, on a tiny GPT-2
(tied embeddings) and a tiny Llama (untied). Each rank's peaks come back; FSDP holds less than
DDP; a rank that runs out of memory ends the probe as `oom` with no rank left waiting in a
collective; a timeout and kill -9 of the search leave no rank behind."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.levers.config import ProbeConfig
from autotune.host.deadline import DeadlineReached
from autotune.vocabulary.errors import DeviceError
from autotune.specs.models import resolve_model
from autotune.probe.runner import ProbeRunner
from autotune.probe.settings import ProbeSettings
from autotune.vocabulary.status import ProbeStatus
from autotune.vocabulary.units import format_size
from tests.helpers.cli import wait_for
from tests.helpers.faults import fault_env, inject_fault
from tests.helpers.models import TINY_GPT2
from tests.helpers.ports import free_port
from tests.helpers.processes import assert_all_gone, cmdline, cpu_seconds, descendants, environment
from tests.helpers.ranks import assert_rank_predicted

pytestmark = pytest.mark.slow

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
GiB = 1 << 30


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rank-models")
    out = {}
    for name, config in (("gpt2", TINY_GPT2), ("llama", TINY_LLAMA)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = str(root / name)
    return out


def _config(model: str, strategy: str) -> ProbeConfig:
    return ProbeConfig(model=model, micro_batch=2, block_size=64, grad_accum=2, gpus=2, strategy=strategy)


def _probe(config: ProbeConfig, budget_bytes: int, timeout: float = 120.0):
    settings = ProbeSettings(device="cpu", measure_seconds=0.0, margin=0, timeout=timeout)
    with ProbeRunner(settings, reuse_child=False) as runner:
        return runner.run(config, settings.budget(budget_bytes), resolve_model(config.model))


def _ranks_below_us() -> set[int]:
    """torchrun's agents and ranks this test process started, still alive."""
    return {
        p
        for p in descendants(os.getpid())
        if b"autotune.probe.rank_main" in cmdline(p) or b"torch.distributed.run" in cmdline(p)
    }


@pytest.fixture(scope="module")
def llama_probes(models, probe_runner):
    """ddp and fsdp of the tiny Llama under a budget that fits both: their results, from the
    worker's warm probe child (clean probes, as a search sends them; the ranks are new each time).
    One timed step each: the peaks are reached in the warm-up, and one step times the throughput."""
    runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1, measure_seconds=0.0, margin=0, timeout=120.0))
    return {
        strategy: runner.run(
            _config(models["llama"], strategy), runner.settings.budget(GiB), resolve_model(models["llama"])
        )
        for strategy in ("ddp", "fsdp")
    }


def test_ddp_and_fsdp_probes_report_each_ranks_peaks(llama_probes):
    for strategy, result in llama_probes.items():
        assert result.status == ProbeStatus.OK, (strategy, result.error)
        assert len(result.rank_peaks) == 2
        assert result.peak_reserved_bytes == max(rank["reserved"] for rank in result.rank_peaks)
        assert result.peak_allocated_bytes == max(rank["allocated"] for rank in result.rank_peaks)
        assert result.tokens_per_s and result.tokens_per_s > 0
        assert result.first_loss is not None and result.last_loss is not None
    # Sharding holds half the parameters, gradients and optimizer state per rank (and no DDP buckets).
    assert llama_probes["fsdp"].peak_reserved_bytes < llama_probes["ddp"].peak_reserved_bytes
    assert _ranks_below_us() == set()


def test_each_ranks_peak_is_the_estimate_of_a_rank(models, llama_probes, trace_children):
    # (tests/estimate/test_ranks.py holds the other strategies, LoRA and tied embeddings.)
    from autotune.estimate import estimate_memories

    strategies = sorted(llama_probes)
    estimates = estimate_memories(
        [_config(models["llama"], s) for s in strategies], device_type="cpu", use_cache=False, children=trace_children
    )
    for strategy, estimate in zip(strategies, estimates):
        assert_rank_predicted(estimate, llama_probes[strategy], largest_unit=1000 * 64 * 4 + 2 * 64 * 4, what=strategy)


def test_one_rank_out_of_memory_ends_the_probe_as_oom_and_no_rank_is_left_waiting(models, monkeypatch, tmp_path):
    # Rank 1 alone runs out of memory in its second step; rank 0 goes on into the step's
    # collectives, where it would wait for rank 1 forever (tests/faults: oom-on-rank-1).
    inject_fault(monkeypatch, "oom-on-rank-1")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # (the probe child's, and the agent's it starts)
    started = time.monotonic()
    result = _probe(_config(models["llama"], "fsdp"), GiB)
    assert result.status == ProbeStatus.OOM, result.error
    assert result.error.startswith("rank 1 of 2: ") and "out of memory" in result.error
    assert time.monotonic() - started < 60  # (the ranks' collective timeout is 120 s: nobody waited for it)
    assert _ranks_below_us() == set()
    # The ranks' run directory is removed, torchrun's own (torchelastic_*) with it. (torch's
    # compile cache, torchinductor_USER, is shared by every run, and kept.)
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_a_probe_past_its_timeout_kills_every_rank(models):
    result = _probe(_config(models["gpt2"], "ddp"), GiB, timeout=2.0)  # (the ranks' imports alone take longer)
    assert result.status == ProbeStatus.TIMEOUT
    assert "every rank was killed" in result.error
    assert_all_gone(_ranks_below_us(), within=2.0)


def test_kill_9_of_a_search_mid_probe_leaves_no_rank(models, tmp_path):
    search = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "search",
            "--model",
            models["gpt2"],
            "--gpu-budget",
            "1GiB",
            "--device",
            "cpu",
            "--gpus",
            "2",
            "--strategies",
            "ddp,fsdp",
            "--block-sizes",
            "64",
            "--micro-batches",
            "1,2",
            "--effective-batch",
            "4",
            "--precisions",
            "fp32",
            "--checkpointing",
            "off",
            "--attention",
            "sdpa",
            "--no-predict",
            "--db",
            f"sqlite:///{tmp_path / 'ranks.db'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def ranks() -> set[int]:
            # The ranks, not torchrun's agent, whose command line names their module too: counting
            # it, "two" was seen only while one rank alone was up (the other not yet started, or
            # ended), a moment the 0.2 s polls caught after 11 to 83 s, and in one run not in 120 s.
            return {
                p
                for p in descendants(search.pid)
                if b"autotune.probe.rank_main" in (command := cmdline(p)) and b"torch.distributed.run" not in command
            }

        try:
            wait_for(lambda: len(ranks()) == 2 or search.poll() is not None, seconds=120, what="two ranks")
            assert search.poll() is None, "the search ended before two ranks were seen"
        except AssertionError as failure:
            # Where the search's processes were, and what it said: for a wait that did not end.
            below = "\n".join(f"{p} {cmdline(p)[:160]!r}" for p in sorted(descendants(search.pid)))
            search.kill()
            raise AssertionError(f"{failure}\n{below}\n{search.communicate()[1][-3000:]}") from None
        below = descendants(search.pid)
        run_dir = Path(environment(min(ranks()))["AUTOTUNE_RANK_DIR"])
        assert run_dir.is_dir()
        search.send_signal(signal.SIGKILL)
        search.wait(timeout=30)
        assert_all_gone(below, within=5.0)  # the janitor among them, once it has removed the directory
        assert not run_dir.exists()
    finally:
        search.kill()


def test_a_rank_whose_agent_died_before_it_tied_itself_leaves_at_once(tmp_path):
    # Its parent is not torchrun's agent (here: this test; after a kill -9 as ranks start: whoever
    # adopted it): it would never see a parent die, so it leaves before doing anything.
    code = "from autotune.probe.rank_main import tie_to_agent; tie_to_agent(); print('tied')"
    env = {**os.environ, "AUTOTUNE_RANK_DIR": str(tmp_path), "RANK": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3 and "tied" not in done.stdout, done.stderr
    assert not (tmp_path / "rank-0.pid").exists()


class SilentProgram:
    """Another program at a port: listens on 127.0.0.1 (as servers do, SO_REUSEADDR), accepts every
    connection and never answers. `stop_listening` keeps what it accepted open, silent (a server
    that closed its listening socket and not yet its connections), and frees the port."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", port))
        self.server.listen(8)
        self.server.settimeout(0.1)
        self.held: list = []
        self.listening = True
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while self.listening:
            try:
                self.held.append(self.server.accept()[0])
            except TimeoutError:
                continue

    def stop_listening(self) -> None:
        self.listening = False
        self.thread.join()
        self.server.close()

    def close(self) -> None:
        if self.listening:
            self.stop_listening()
        for connection in self.held:
            connection.close()


def _start_node(port: int, env: dict | None = None, *args: str) -> subprocess.Popen:
    """`autotune node` as the second of two single-rank "nodes" on this machine (loopback only)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "node",
            "--rendezvous",
            f"127.0.0.1:{port}",
            "--nodes",
            "2",
            "--node-rank",
            "1",
            "--gpus",
            "1",
            "--device",
            "cpu",
            "--rounds",
            "1",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _stop_node(node: subprocess.Popen) -> None:
    """SIGTERM, as a user's Ctrl-C or a scheduler does: the node removes its round's directory on
    the way out (a kill -9 would leave it in /tmp); SIGKILL if it has not ended within a minute."""
    if node.poll() is None:
        node.terminate()
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


def _line_from(stream, needle: str, seconds: float) -> str:
    """The first line of `stream` (a pipe) with `needle` in it, within `seconds`."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(stream.readline, "")], daemon=True).start()
    deadline = time.monotonic() + seconds
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if needle in line:
            return line.strip()
        seen.append(line)
    raise AssertionError(f"no line with {needle!r} within {seconds:.0f} s; saw {''.join(seen)!r}")


# Two nodes' agents and ranks import torch side by side: on a busy machine that alone took past a
# fixed 120 s. So the multi-node probes wait as long as their processes make progress (CPU time
# spent, a phase reached), and fail after this long without any; the probe's own timeout is only a
# backstop far beyond.
STALL_SECONDS = 180.0
BACKSTOP_SECONDS = 1800.0


class WhileProgressing:
    """A Deadline (autotune.host.deadline's interface, as the runner polls it) that expires once the
    processes this test started have reached no new phase and used less than PROGRESS_CPU_SECONDS
    of CPU (importing, building, stepping; not an agent's idle polling) for `stall` seconds."""

    PROGRESS_CPU_SECONDS = 5.0
    # The runner asks every 0.1 s; a scan of /proc for the CPU time takes some 5 ms, which, ten
    # times a second for the whole probe, was most of the test process's CPU in a two-node test
    # (0.8 s; 0.1 s scanning once a second, as good against a stall of minutes).
    SAMPLE_SECONDS = 1.0

    def __init__(self, stall: float = STALL_SECONDS) -> None:
        self.stall = stall
        self.mark_cpu, self.last_progress = 0.0, time.monotonic()
        self.sampled = -math.inf

    def progressed(self, *_: object) -> None:
        self.last_progress = time.monotonic()

    def expired(self) -> bool:
        now = time.monotonic()
        if now - self.sampled >= self.SAMPLE_SECONDS:
            self.sampled = now
            cpu = cpu_seconds(descendants(os.getpid()))
            if cpu < self.mark_cpu or cpu - self.mark_cpu >= self.PROGRESS_CPU_SECONDS:  # (fewer: some processes ended)
                self.mark_cpu = cpu
                self.progressed()
        return time.monotonic() - self.last_progress > self.stall

    def remaining(self) -> float:
        return float("inf")

    def allows(self, seconds: float) -> bool:
        return True

    def bound(self, seconds: float) -> float:
        return seconds


def _multi_node_probe(model: str, port: int):
    """The first node's probe of a run on two single-rank nodes meeting at 127.0.0.1:`port`."""
    config = ProbeConfig(model=model, micro_batch=2, block_size=64, gpus=1, nodes=2, strategy="fsdp")
    settings = ProbeSettings(
        device="cpu", measure_seconds=0.0, margin=0, timeout=BACKSTOP_SECONDS, rendezvous=f"127.0.0.1:{port}"
    )
    progress = WhileProgressing()
    with ProbeRunner(settings, reuse_child=False) as runner:
        runner.on_phase = progress.progressed
        try:
            return runner.run(config, settings.budget(GiB), resolve_model(model), deadline=progress)  # type: ignore[arg-type]
        except DeadlineReached:
            pytest.fail(f"the two nodes' processes made no progress (no CPU time, no phase) for {STALL_SECONDS:.0f} s")


def _node_output(node: subprocess.Popen) -> tuple[str, str]:
    """The node's output once it ends: its rank has reported by now, and it ends as soon as its
    agent does; the time allowed is the stall allowance (its processes may wait for cores)."""
    return node.communicate(timeout=STALL_SECONDS)


def test_two_single_rank_nodes_meet_through_torchruns_rendezvous(models):
    port = free_port("")  # (on every address, as torchrun's store listens)
    node = _start_node(port)
    try:
        result = _multi_node_probe(models["llama"], port)
        out, err = _node_output(node)
    finally:
        _stop_node(node)
    assert result.status == ProbeStatus.OK, result.error
    assert len(result.rank_peaks) == 2 and all(rank["reserved"] > 0 for rank in result.rank_peaks)
    assert node.returncode == 0, err
    assert out.strip() == f"probe 1: rank 1 ok peak {format_size(result.rank_peaks[1]['reserved'])}"
    assert _ranks_below_us() == set()


def test_a_rank_out_of_memory_on_another_node_is_the_probes_oom(models):
    port = free_port("")  # (on every address, as torchrun's store listens)
    node = _start_node(port, env=fault_env("oom-on-rank-1"))
    try:
        result = _multi_node_probe(models["llama"], port)
        _node_output(node)
    finally:
        _stop_node(node)
    assert result.status == ProbeStatus.OOM, result.error
    assert result.error.startswith("rank 1 of 2: ") and "out of memory" in result.error


# The first node's wait for the others in the tests below (RENDEZVOUS_SECONDS, 300 s, in use), and
# what starting its agent (torch's import) may add on a busy machine.
# Nobody arrives: all of it is waited out, idle, so it is kept short. Its clock starts once the first
# node's agent has imported torch and listens (torch's store timeout), so a busy machine does not eat it.
RENDEZVOUS_SECONDS = 2
STARTUP_ALLOWANCE = 120


@pytest.mark.parametrize("node", ["absent", "held by another program"])
def test_a_node_that_never_arrives_ends_the_probe_in_one_line_naming_it(models, monkeypatch, node):
    # "held": the hang of a port another process took between "found free" and "bound", made
    # certain. The node's agent connects to that program, which never answers (torch's client
    # waits for the answer without a timeout); the program then stops listening, keeping the
    # connection; the first node listens on the port and waits for a node that is held elsewhere.
    # Without a bound both waited out torchrun's 600 s, doing nothing.
    monkeypatch.setattr("autotune.probe.torchrun.RENDEZVOUS_SECONDS", RENDEZVOUS_SECONDS)
    port = free_port("")  # (on every address, as torchrun's store listens)
    other = started = None
    try:
        if node != "absent":
            other = SilentProgram(port)
            started = _start_node(port)
            wait_for(lambda: other.held, seconds=STARTUP_ALLOWANCE, what="the node's agent to connect")
            other.stop_listening()
        began = time.monotonic()
        with pytest.raises(DeviceError) as refused:
            _multi_node_probe(models["llama"], port)
        took = time.monotonic() - began
    finally:
        if started is not None:
            _stop_node(started)
        if other is not None:
            other.close()
    message = str(refused.value)
    assert message.startswith(
        f"node 1 of 2 did not reach the rendezvous at 127.0.0.1:{port} within "
        f"{RENDEZVOUS_SECONDS} s: run `autotune node --rendezvous 127.0.0.1:{port} --nodes 2 "
        f"--node-rank 1` on the other node"
    ), message
    assert "\n" not in message
    assert took < RENDEZVOUS_SECONDS + STARTUP_ALLOWANCE
    assert_all_gone(_ranks_below_us(), within=10.0)


def test_a_rendezvous_port_another_program_listens_on_is_said_on_both_nodes(models, tmp_path):
    port = free_port("")  # (on every address, as torchrun's store listens)
    other = SilentProgram(port)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    node = _start_node(port, {**os.environ, "TMPDIR": str(temporary)}, "--rendezvous-timeout", "5")
    try:
        began = time.monotonic()
        with pytest.raises(DeviceError) as refused:  # (the first node cannot listen there: at once)
            _multi_node_probe(models["llama"], port)
        assert time.monotonic() - began < STARTUP_ALLOWANCE
        # The node's agent connected to that program and waits for its answer, which torch does not
        # bound: the node stops it after its timeout (and 5 s more for a start) and says so.
        said = _line_from(node.stderr, "torchrun's agent was still waiting", seconds=10 + STARTUP_ALLOWANCE)
        assert node.poll() is None  # (it waits on for the first node's probes)
    finally:
        _stop_node(node)
        other.close()
    message = str(refused.value)
    assert (
        message.startswith(
            f"the rendezvous port {port} is taken on this node by another program (address already in use)"
        )
        and "\n" not in message
    ), message
    assert "stop that program, or give every node another --rendezvous port" in message, message
    assert said == (
        f"node 1 of 2: torchrun's agent was still waiting for an answer from 127.0.0.1:{port} after 10 s: "
        "something there accepted its connection and never answered as the first node's rendezvous does "
        "(another program holding that port?); stopped it, waiting for the first node's next probe"
    )
    assert_all_gone(_ranks_below_us(), within=10.0)
    # Stopped between rounds, the node removed its round's directory (torchrun's log directory in it).
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
