"""TrainingArguments' optimizer names: accepted wherever an optimizer is named, stored under
autotune's name, and handed back to Trainer as its own."""

from __future__ import annotations

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import resolve_model
from autotune.levers.recipes import OPTIMIZERS, canonical_optimizer, check_optimizer
from autotune.search.space import SearchSpace
from tests.helpers.cli import assert_usage_error, invoke


@pytest.mark.parametrize(
    "given, stored",
    [
        ("adamw_torch_fused", "adamw"),
        ("ADAMW_TORCH_FUSED", "adamw"),
        ("adamw_bnb_8bit", "adamw_8bit"),
        ("adamw_torch", "adamw_torch"),
        ("adamw", "adamw"),
        ("adafactor", "adafactor"),
    ],
)
def test_trainers_names_are_stored_under_autotunes(given, stored):
    config = ProbeConfig(model="gpt2", micro_batch=1, block_size=8, optimizer=given)
    assert config.optimizer == stored == canonical_optimizer(given) == check_optimizer(given)
    # one study for both names: the stored key is the same
    assert config.key() == ProbeConfig(model="gpt2", micro_batch=1, block_size=8, optimizer=stored).key()


def test_torchs_default_adamw_is_its_own_optimizer_handed_off_as_adamw_torch():
    assert OPTIMIZERS["adamw_torch"].optim == "adamw_torch"
    assert OPTIMIZERS["adamw"].optim == "adamw_torch_fused"


def test_a_search_space_merges_two_names_of_one_optimizer():
    space = SearchSpace.build(resolve_model("gpt2"), optimizers=("adamw_torch_fused", "adamw", "adamw_torch"))
    assert space.optimizers == ("adamw", "adamw_torch")


def test_an_unknown_name_lists_every_accepted_one():
    with pytest.raises(BadInput, match="adamw_torch_fused"):
        ProbeConfig(model="gpt2", micro_batch=1, block_size=8, optimizer="adamw_apex_fused")
    with pytest.raises(BadInput, match="adamw_bnb_8bit"):
        check_optimizer("lion")


def test_the_command_line_takes_trainers_names():
    proc = invoke(  # (a refusal: read in this process)
        "plan", "--model", "gpt2", "--gpu-budget", "8GiB", "--optimizers", "adamw_torch_fused,nope", "--json"
    )
    assert_usage_error(proc, "--optimizers: unknown value 'nope'")
    assert "adamw_torch_fused" in proc.stderr and "adamw_bnb_8bit" in proc.stderr
