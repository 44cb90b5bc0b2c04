"""The run's later phases in the estimate: evaluation and generation traced after the training
steps, each phase's peaks equal to the CPU probe's to the byte; and, without processes, how the
replay tells the phases apart, how generate's value reads are answered, and how the per-phase
figures travel (the estimate, its cache, interpolation)."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.levers import evaluation
from autotune.levers.config import ProbeConfig
from autotune.estimate import MemoryEstimate, estimate_memories
from autotune.estimate.cache import EstimateCache
from autotune.estimate.interpolate import interpolated
from autotune.estimate.predict import _from_trace
from autotune.estimate.protocol import TraceResult
from autotune.specs.models import resolve_model
from autotune.search.space import single_config
from tests.helpers.models import write_model_dir
from tests.helpers.tiny_tasks import write_tiny

GiB = 2**30

# name -> (model directory, levers): each kind of later phase the probe runs.
CASES = {
    # Trainer's kept logits, piled on the card for three eval batches
    "gpt2 kept logits": (
        "gpt2",
        {
            "micro_batch": 2,
            "block_size": 64,
            "evaluation": {"eval_batch": 4, "eval_logits": "kept", "eval_accumulation_steps": 3},
        },
    ),
    # loss only: two eval batches, the second after the first's memory is given back
    "gpt2 loss only": (
        "gpt2",
        {"micro_batch": 2, "block_size": 64, "precision": "bf16", "evaluation": {"eval_batch": 4}},
    ),
    "bert classification": (
        "bert-classification",
        {
            "micro_batch": 2,
            "block_size": 64,
            "evaluation": {"eval_batch": 4, "eval_logits": "kept", "eval_accumulation_steps": 2},
        },
    ),
    # padded batches with their attention mask, expanded by eager attention (autotune.levers.tasks.padded_lengths)
    "bert classification eager": (
        "bert-classification",
        {"micro_batch": 3, "block_size": 64, "attention": "eager", "evaluation": {"eval_batch": 2}},
    ),
    "pegasus eager, one row": (
        "pegasus",
        {
            "micro_batch": 1,
            "block_size": 64,
            "target_length": 16,
            "attention": "eager",
            "evaluation": {"eval_batch": 1},
        },
    ),
    # beam search to the whole length, then the loss forward
    "t5 beams": (
        "t5",
        {
            "micro_batch": 2,
            "block_size": 64,
            "target_length": 16,
            "evaluation": {"eval_batch": 2, "generate": True, "num_beams": 3},
        },
    ),
    # greedy generation; kept outputs hold the encoder's states too
    "pegasus greedy": (
        "pegasus",
        {
            "micro_batch": 2,
            "block_size": 64,
            "target_length": 16,
            "evaluation": {"eval_batch": 2, "eval_logits": "kept", "eval_accumulation_steps": 2, "generate": True},
        },
    ),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, ProbeConfig]:
    root = tmp_path_factory.mktemp("phases")
    dirs = {"gpt2": write_model_dir(root / "gpt2")}
    dirs.update({family: write_tiny(root, family) for family in ("bert-classification", "t5", "pegasus")})
    return {name: single_config(resolve_model(str(dirs[model])), **levers) for name, (model, levers) in CASES.items()}


@pytest.fixture(scope="module")
def estimated_and_measured(configs, probe_runner, trace_children) -> dict:
    """Every case estimated for the CPU (one trace child) and probed on the CPU (one probe child)."""
    from autotune.probe import ProbeSettings

    estimates = estimate_memories(list(configs.values()), device_type="cpu", use_cache=False, children=trace_children)
    runner = probe_runner(ProbeSettings(device="cpu", warmup_steps=2, measure_steps=1, measure_seconds=0.0))
    probes = [runner.run(config, runner.settings.budget(2 * GiB)) for config in configs.values()]
    return {name: (estimate, probe) for name, estimate, probe in zip(configs, estimates, probes)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_phase_equals_the_cpu_probe_to_the_byte(case, configs, estimated_and_measured):
    estimate, probe = estimated_and_measured[case]
    assert probe.status == "ok", probe.error
    assert tuple(probe.phase_peaks) == evaluation.phases(configs[case])
    assert estimate.unestimated_phases == {}
    assert estimate.phase_peaks == probe.phase_peaks, case
    # The overall peaks are the largest phase's, as the probe's are.
    assert (estimate.peak_bytes, estimate.reserved_bytes) == (probe.peak_allocated_bytes, probe.peak_reserved_bytes)
    assert estimate.peak_bytes == max(p["allocated"] for p in estimate.phase_peaks.values())
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes


@pytest.mark.slow
def test_what_each_phase_holds(estimated_and_measured):
    peaks = {name: estimate.phase_peaks for name, (estimate, _) in estimated_and_measured.items()}
    # Kept logits (3 x 4 x 64 x vocab 1024, fp32: 3 MiB) put the peak in evaluation, above training.
    kept = estimated_and_measured["gpt2 kept logits"][0]
    assert kept.peak_phase == "evaluation" and peaks["gpt2 kept logits"]["eval"]["allocated"] > 3 * 2**20
    assert peaks["gpt2 loss only"]["eval"]["allocated"] < peaks["gpt2 loss only"]["train"]["allocated"]
    # An eval phase starts from the training state resident (weights and optimizer state), and adds to it.
    for name, (estimate, _) in estimated_and_measured.items():
        assert (
            estimate.optimizer > 0 and estimate.phase_peaks["eval"]["allocated"] > estimate.params + estimate.optimizer
        ), name
    # Three beams to the whole length, on top of the resident state: more than the eval forward.
    assert peaks["t5 beams"]["generate"]["allocated"] > peaks["t5 beams"]["eval"]["allocated"]


# -- without processes ------------------------------------------------------------------------------


def _events(*sizes: int):
    """Allocation events of storages of `sizes` (a negative size frees the storage of that size)."""
    from autotune.estimate.ledger import _Storage

    live: dict[int, _Storage] = {}
    events = []
    for size in sizes:
        if size > 0:
            live[size] = _Storage(size, "forward")
            events.append((1, live[size], "forward"))
        else:
            events.append((-1, live.pop(-size), ""))
    return events


def test_replay_starts_each_phase_from_what_is_held():
    pytest.importorskip("torch")
    from autotune.estimate.ledger import replay

    # train: 1000 + 3000 live, then 3000 freed; eval from 1000: + 600; generate from 1600: + 2000, partly
    events = _events(1000, 3000, -3000, 600, 2000, -2000)
    replayed = replay(events, cuda=False, stages=[(3, "eval"), (4, "generate")])
    assert replayed["phase_peaks"] == {
        "train": {"allocated": 4000, "reserved": 4096},
        "eval": {"allocated": 1600, "reserved": 2048},  # from the 1000 held (1024 rounded) as it began
        "generate": {"allocated": 3600, "reserved": 4096},
    }
    assert replayed["peak_bytes"] == 4000 and replayed["reserved_bytes"] == 4096
    # A phase left out (not traced to its end) is replayed but counted nowhere.
    events = _events(1000, 600, 5000, -5000)
    left = replay(events, cuda=False, stages=[(1, "eval"), (2, "generate")], left_out={"generate"})
    assert set(left["phase_peaks"]) == {"train", "eval"} and left["peak_bytes"] == 1600
    # The CUDA allocator model: a phase's reserved starts at what is reserved, not at zero.
    cuda = replay(_events(1000, -1000, 600), cuda=True, stages=[(2, "eval")])
    assert cuda["phase_peaks"]["eval"]["reserved"] == cuda["phase_peaks"]["train"]["reserved"] == 2 * 2**20


def test_generate_reads_are_answered_only_where_the_real_run_is_known():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from autotune.estimate.generation import GenerationReads, UnansweredRead
    from autotune.estimate.ledger import Ledger

    # Named and written as transformers' own readers are (generation/utils.py).
    def _get_logits_processor(encoder_input_ids):
        has_encoder_input_ids = (
            encoder_input_ids is not None and encoder_input_ids.dim() == 2 and not (encoder_input_ids < 0).any()
        )
        return has_encoder_input_ids

    def _beam_search(cur_len, max_length, flags):
        this_peer_finished = not flags.any()  # not self._beam_search_has_unfinished_sequences(
        return this_peer_finished

    def elsewhere(x):
        return bool(x.sum() > 0)

    ledger = Ledger()
    with FakeTensorMode(), ledger:
        ids = torch.randint(0, 10, (2, 4))
        with pytest.raises(DataDependentOutputException):
            bool((ids < 0).any())  # outside generate nothing is answered
        ledger.reads = GenerationReads(max_length=8)
        assert _get_logits_processor(ids) is True  # the probe's ids are drawn from the vocabulary
        # Every beam runs to max_length (the probe asks min_length = max_length).
        assert _beam_search(7, 8, ids > 0) is False and _beam_search(8, 8, ids > 0) is True
        with pytest.raises(UnansweredRead, match="lack 'cur_len'"):  # a loop that names its length otherwise
            _other_beam_search(ids > 0)
        with pytest.raises(UnansweredRead, match=r"elsewhere: return bool\(x.sum\(\) > 0\)"):
            elsewhere(ids)
        assert torch.tensor(3).item() == 3  # a value the fake tensor knows is its own


def _beam_search(flags):
    this_peer_finished = not flags.all()  # not self._beam_search_has_unfinished_sequences(
    return this_peer_finished


_other_beam_search = _beam_search


def _result(**phase_peaks) -> TraceResult:
    return TraceResult(
        index=0,
        peak_bytes=900,
        breakdown={"params": 100, "grads": 0, "optimizer": 200, "activations": 600, "temporaries": 0},
        peak_phase="evaluation",
        reserved_bytes=1024,
        segments=0,
        build_seconds=0.0,
        trace_seconds=0.0,
        replay_seconds=0.0,
        events=0,
        kernels={},
        torch_version="",
        phase_peaks=phase_peaks,
        unestimated={"generate": "generate reads a value at x.py:1"},
    )


def test_per_phase_figures_travel_with_the_estimate(tmp_path):
    config = ProbeConfig(
        model="m", micro_batch=2, block_size=8, task="seq2seq", target_length=4, eval_batch=2, generation_max_length=8
    )
    result = _result(train={"allocated": 800, "reserved": 1024}, eval={"allocated": 900, "reserved": 1024})
    cuda = _from_trace(config, "cuda", result, [], seconds=0.0, trace_seconds=0.0)
    # The cuBLAS workspaces are held in every phase.
    assert cuda.phase_peaks["eval"]["allocated"] == 900 + cuda.workspace and cuda.peak_bytes == 900 + cuda.workspace
    assert cuda.phase_required_bytes("eval") == 1024 + cuda.workspace + cuda.context_bytes
    assert cuda.phase_required_bytes("generate") is None
    # A phase not estimated is said, with why, and is in no figure.
    cpu = _from_trace(config, "cpu", result, [], seconds=0.0, trace_seconds=0.0)
    assert cpu.unestimated_phases == {"generate": "generate reads a value at x.py:1"}
    assert any(note.startswith("generate phase not estimated: generate reads a value") for note in cpu.notes)
    data = cpu.to_dict()
    assert (
        data["phase_peaks"]["eval"] == {"allocated": 900, "reserved": 1024} and "generate" in data["unestimated_phases"]
    )
    # The cache keeps them.
    cache = EstimateCache(tmp_path / "estimates.json")
    cache.put("k", cpu)
    again = EstimateCache(tmp_path / "estimates.json").get("k", 0.0)
    assert (
        again is not None
        and again.phase_peaks == cpu.phase_peaks
        and again.unestimated_phases == cpu.unestimated_phases
    )
    # Interpolated between two traced micro-batches, phase by phase.
    high = dataclasses.replace(
        cpu,
        config=dataclasses.replace(config, micro_batch=4),
        phase_peaks={"train": {"allocated": 1600, "reserved": 2048}, "eval": {"allocated": 1100, "reserved": 1536}},
    )
    middle = interpolated(dataclasses.replace(config, micro_batch=3), cpu, high, 0.5)
    assert isinstance(middle, MemoryEstimate)
    assert middle.phase_peaks == {
        "train": {"allocated": 1200, "reserved": 1536},
        "eval": {"allocated": 1000, "reserved": 1280},
    }


@pytest.mark.slow
def test_a_group_whose_peak_changes_phase_is_interpolated_phase_by_phase(tmp_path, trace_children):
    """Micro-batch 1 of a tiny GPT-2 with --eval-batch 8 peaks in its eval phase, micro-batch 4 in
    training: the chord of the largest phase put micro-batch 2 15% over its trace, a false skip on
    CPU (benchmarks/interpolation.py). Each phase's chord follows it; a search's floor stays under."""
    from autotune.estimate.interpolate import INTERPOLATION_OVERSHOOT, between
    from autotune.search.predictions import predict

    model = str(write_model_dir(tmp_path / "gpt2"))
    group = [ProbeConfig(model, mb, 64, grad_accum=8 // mb, eval_batch=8) for mb in (1, 2, 4)]
    exact = {
        e.config.micro_batch: e
        for e in estimate_memories(group, device_type="cpu", use_cache=False, children=trace_children)
    }
    assert exact[1].phase_peaks["eval"]["allocated"] > exact[1].phase_peaks["train"]["allocated"]
    assert exact[4].phase_peaks["train"]["allocated"] > exact[4].phase_peaks["eval"]["allocated"]
    low, high, t = between(group[1], [exact[1], exact[4]])
    chord = low.peak_bytes + t * (high.peak_bytes - low.peak_bytes)
    assert chord > 1.10 * exact[2].peak_bytes  # the old interpolation's overshoot
    middle = interpolated(group[1], low, high, t)
    assert exact[2].peak_bytes <= middle.peak_bytes < 1.01 * exact[2].peak_bytes
    assert exact[2].reserved_bytes <= middle.reserved_bytes < 1.01 * exact[2].reserved_bytes
    assert sum(middle.breakdown.values()) == middle.peak_bytes
    floor = predict(group, "cpu")[group[1].key()].floor_bytes
    assert floor <= exact[2].floor_bytes and floor >= (1 - 2 * INTERPOLATION_OVERSHOOT) * exact[2].floor_bytes
