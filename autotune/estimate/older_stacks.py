"""Make the installed libraries allocate, in a trace, what older versions allocated (the behaviours
and where they changed: estimate/stack.py). Imported only by the trace child; it imports torch.

Each emulation changes lifetimes only: what the older library kept alive longer is kept alive
as long, so that the ledger sees it; nothing computes differently.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.estimate.stack import Stack

_SOFTMAXES = (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default)


class SoftmaxInputsKept(TorchDispatchMode):
    """torch before 1.11 saved softmax's and log-softmax's input for backward beside the output
    (`_softmax_backward_data(grad, result, dim, self)`; pytorch#64000, fixed for 1.11), though the
    backward reads only the output. Keep each input alive as long as its output, which the backward
    holds until it runs: the attention probabilities' scores in every layer, a language model's
    logits. (Under no_grad nothing was saved: left alone.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SOFTMAXES and torch.is_grad_enabled():
            weakref.finalize(out.untyped_storage(), _keep, args[0])  # (holds the input until the output dies)
        return out


def _keep(_tensor: torch.Tensor) -> None:
    """Nothing to do: the finalizer's reference was what kept the tensor alive."""


@contextlib.contextmanager
def four_bit_inputs_kept(keep: bool):
    """Make each 4-bit layer keep its input until backward, as bitsandbytes before 0.43.2 did."""
    if not keep:
        yield
        return
    from bitsandbytes.autograd._functions import MatMul4Bit

    forward = MatMul4Bit.forward

    def keeping(ctx, A, B, *args, **kwargs):
        out = forward(ctx, A, B, *args, **kwargs)
        if any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, B)
        return out

    MatMul4Bit.forward = staticmethod(keeping)  # type: ignore[method-assign]
    try:
        yield
    finally:
        MatMul4Bit.forward = staticmethod(forward)  # type: ignore[method-assign]


def zeroing_grads_in_place(optimizer: torch.optim.Optimizer) -> None:
    """The probe frees the gradients after each optimizer step; torch before 2.0 zeroed them in
    place by default (`model.zero_grad()` in Trainer), so they stayed allocated into the next step."""
    zero_grad = optimizer.zero_grad
    optimizer.zero_grad = lambda set_to_none=True: zero_grad(set_to_none=False)  # type: ignore[method-assign]


def softmax_inputs_kept(stack: Stack) -> contextlib.AbstractContextManager:
    """SoftmaxInputsKept where `stack` kept softmax inputs, else nothing: entered above the fake
    tensor mode (as the ledger is), so that it sees every op."""
    return SoftmaxInputsKept() if stack.keeps_softmax_inputs else contextlib.nullcontext()
