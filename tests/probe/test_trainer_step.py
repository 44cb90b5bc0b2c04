"""The probe's step as the run's trainer takes it (autotune/probe/step.py): TRL's SFTTrainer step
(`--trainer trl`) trains the same loss as Trainer's, through TRL's own fused LM head, and reads its
metrics to the host every micro-step, before the backward, as SFTTrainer's compute_loss does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from autotune.levers.config import ProbeConfig  # noqa: E402
from autotune.specs.models import resolve_model  # noqa: E402
from autotune.probe.step import ProbeStep, build_random_model, make_optimizer  # noqa: E402
from tests.helpers.models import TINY_GPT2, write_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("trainer-step") / "tiny", **TINY_GPT2))


def stepped(model_dir: str, trainer: str, reads: list[str]) -> tuple[list[float], ProbeStep]:
    """Three optimizer steps of 3 micro-steps from the same weights and batches; `reads` gets each
    host read of a tensor's value (`.item()`) as it happens, and "backward" at each backward."""
    cpu = torch.device("cpu")
    config = ProbeConfig(model=model_dir, micro_batch=2, block_size=32, grad_accum=3, trainer=trainer)
    torch.manual_seed(0)
    model, hf_config = build_random_model(resolve_model(model_dir), config, cpu, False)
    model.eval()  # (no dropout: both trainers' losses from the same weights are comparable)
    step = ProbeStep(model, make_optimizer(model, cpu, config.optimizer), config, cpu, hf_config.vocab_size)
    item, backward = torch.Tensor.item, torch.Tensor.backward

    def read(tensor):
        reads.append("item")
        return item(tensor)

    def traced_backward(tensor, *args, **kwargs):
        reads.append("backward")
        return backward(tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "item", read)
        patch.setattr(torch.Tensor, "backward", traced_backward)
        losses = [step() for _ in range(3)]
    return losses, step


def test_trls_step_trains_trainers_loss_and_reads_its_metrics_every_micro_step(model_dir):
    plain_reads: list[str] = []
    trl_reads: list[str] = []
    plain, _ = stepped(model_dir, "transformers", plain_reads)
    trl, step = stepped(model_dir, "trl", trl_reads)
    # The same loss (the mean negative log-likelihood of the next token), step after step, through
    # TRL's fused head (patched onto the model, as SFTTrainer patches it).
    assert trl == pytest.approx(plain, rel=1e-4)
    assert step.model.forward.__func__ is not type(step.model).forward
    # Trainer's step reads the loss once per optimizer step (its log); TRL's also reads entropy,
    # token accuracy and the batch's tokens (its mask's sum) after each micro-step's forward, before
    # its backward.
    assert plain_reads == (["backward"] * 3 + ["item"]) * 3
    assert trl_reads == ((["item"] * 3 + ["backward"]) * 3 + ["item"]) * 3
