"""Make a trace on fake CPU tensors allocate what a CUDA run allocates.

Four places where PyTorch's CPU and CUDA paths differ in memory, each emulated here (imported
only by the trace child; it imports torch):

1. Dropout. On CUDA, `F.dropout` in training runs the fused `native_dropout`, which keeps a
   1-byte bool mask for backward; on CPU it multiplies by a noise tensor of the input's dtype
   (4 bytes in fp32). In-place dropout takes the unfused path on CUDA too, so it is left alone.
2. SDPA. On CUDA, `scaled_dot_product_attention` runs the flash kernel (fp16/bf16, no mask) or the
   memory-efficient kernel (fp32, or with a mask; no grouped query heads), which keep only a
   B x H x S fp32 logsumexp for backward, else the math kernel; CPU runs the math kernel during
   training (dropout rules its flash kernel out), which keeps the S x S attention matrix. Both CUDA kernels are called through their own aten ops, so
   their meta kernels give the shapes and their autograd formulas the saved tensors.
3. Autocast. CUDA autocast has its own op lists (`pow`, `layer_norm`, `softmax`, `log_softmax`,
   `nll_loss`, `sum` ... run in fp32); CPU autocast another. The CUDA lists are copied below from
   `ATen/autocast_mode.h` (torch 2.13, the X-macros that define CUDA's policy; a test compares
   them with the installed header) and installed as Python kernels on the `AutocastCPU` dispatch
   key. Ops that only the CPU list casts get a pass-through kernel, so CPU autocast behaves as
   CUDA autocast. Matrix products on both lists keep CPU's C++ kernels, which do the same
   lower-precision cast and cache the weight casts as CUDA does.
4. TRL's chunked log-probabilities (`--trainer trl`). On CUDA its Triton kernels fold each tile of
   logits into running statistics in place, write the tile's gradient in place, and accumulate the
   gradient products into fp32 with `addmm(out_dtype=float32, out=...)`; without Triton (a CPU
   trace) TRL folds in torch, with several tile-sized fp32 temporaries (a tile is 4,096 tokens x
   32,768 vocabulary columns: 512 MiB each), and casts both factors to fp32. Those three functions
   of `trl.kernels.chunked_logprob` are replaced by ones that allocate nothing, as the kernels do
   (the values are fake).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

# --- CUDA autocast policy (ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE; norm's fp32_append_dtype overloads) ---
LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
    # fp32_append_dtype: norm gets dtype=float appended; memory-wise an fp32 cast
    "norm.Scalar",
    "norm.ScalarOpt_dim",
)
FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

_LOW = (torch.float16, torch.bfloat16)
_EXCLUDE_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 and x.device.type == "cpu"


def _cast(args: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda x: x.to(dtype) if _eligible(x) and x.dtype != dtype else x, args)


def _fp32_kernel(op):
    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST):
            return op(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))

    return kernel


def _lower_kernel(op):
    def kernel(keyset, *args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST):
            return op(*_cast(args, dtype), **_cast(kwargs, dtype))

    return kernel


def _set_opt_dtype_kernel(op):
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype")

    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST):
            if args and _eligible(args[0]):
                if len(args) > dtype_at:
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _promote_kernel(op):
    def kernel(keyset, *args, **kwargs):
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if _eligible(x)]
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST):
            if not tensors:
                return op(*args, **kwargs)
            widest = tensors[0].dtype
            for t in tensors[1:]:
                widest = torch.promote_types(widest, t.dtype)
            return op(*_cast(args, widest), **_cast(kwargs, widest))

    return kernel


def _passthrough_kernel(op):
    # Like a fallthrough: skip autocast for this call only; ops it decomposes into still see it.
    def kernel(keyset, *args, **kwargs):
        return op.redispatch(keyset.remove(torch._C.DispatchKey.AutocastCPU), *args, **kwargs)

    return kernel


def install_cuda_autocast() -> torch.library.Library:
    """Give CPU autocast CUDA's op lists for the rest of this process. Keep the returned library
    alive: dropping it restores CPU's kernels."""
    lib = torch.library.Library("aten", "IMPL")
    cpu_lowered = set()
    cuda_ops = set(LOWER_PRECISION_FP) | set(FP32) | set(FP32_SET_OPT_DTYPE) | set(PROMOTE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        for qualified in torch._C._dispatch_get_all_op_names():
            if not qualified.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(
                qualified, "AutocastCPU"
            ):
                continue
            name = qualified[len("aten::") :]
            if name in LOWER_PRECISION_FP:
                cpu_lowered.add(name)  # same policy on CPU: keep its C++ kernel and weight-cast cache
            elif name not in cuda_ops:
                lib.impl(name, _passthrough_kernel(_overload(name)), "AutocastCPU", with_keyset=True)
        for names, make in (
            (FP32, _fp32_kernel),
            (FP32_SET_OPT_DTYPE, _set_opt_dtype_kernel),
            (PROMOTE, _promote_kernel),
            (LOWER_PRECISION_FP, _lower_kernel),
        ):
            for name in names:
                if name in cpu_lowered:
                    continue
                try:
                    op = _overload(name)
                except AttributeError:  # an op this torch does not have
                    continue
                lib.impl(name, make(op), "AutocastCPU", with_keyset=True)
    return lib


class CudaKernels:
    """Route dropout and SDPA to the kernels CUDA would run (see the module docstring).

    A context manager that patches `torch.nn.functional.dropout`, `torch.dropout` and
    `torch.nn.functional.scaled_dot_product_attention` for its duration. Patching rather than a
    TorchFunctionMode: a mode is switched off inside its own handler, and `loss.backward()` passes
    through that handler, so checkpointing's recomputation would run unpatched and save other
    tensors than the forward did (torch.utils.checkpoint refuses that). Patching also costs nothing
    on the other ops. `kernels` counts what ran."""

    def __init__(self) -> None:
        self.kernels: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "CudaKernels":
        self._orig_dropout = F.dropout
        self._orig_torch_dropout = torch.dropout
        self._orig_sdpa = F.scaled_dot_product_attention
        patches: list[tuple[object, str, Any]] = [
            (F, "dropout", self._dropout),
            (torch, "dropout", self._torch_dropout),
            (F, "scaled_dot_product_attention", self._sdpa),
        ]
        # (imported before the trace where the config needs it: autotune.probe.step.import_recipe_code)
        if (chunked := sys.modules.get("trl.kernels.chunked_logprob")) is not None:
            patches += [
                (chunked, name, self._in_place(name)) for name in ("_forward_tile", "_backward_tile", "_addmm_fp32")
            ]
        for owner, name, fn in patches:
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, fn)
        return self

    def _in_place(self, name: str):
        """A stand-in for one of TRL's tile functions that allocates nothing (module docstring, 4)."""

        def kernel(*args, **kwargs) -> None:
            self._count(f"trl{name}")

        return kernel

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            owner, name, fn = self._saved.pop()
            setattr(owner, name, fn)

    def _count(self, name: str) -> None:
        self.kernels[name] = self.kernels.get(name, 0) + 1

    def _fused_dropout(self, x, p, training, inplace) -> Any:
        if training and 0 < p < 1 and not inplace and x.numel() > 0:
            self._count("native_dropout")
            return torch.native_dropout(x, p, True)[0]
        return None

    def _dropout(self, input, p=0.5, training=True, inplace=False):
        out = self._fused_dropout(input, p, training, inplace)
        return out if out is not None else self._orig_dropout(input, p, training, inplace)

    def _torch_dropout(self, input, p, train):
        out = self._fused_dropout(input, p, train, False)
        return out if out is not None else self._orig_torch_dropout(input, p, train)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        q, k, v, mask = query, key, value, attn_mask
        if torch.is_autocast_enabled("cpu"):  # SDPA is on the lower-precision list: cast before choosing
            q, k, v = _cast((q, k, v), torch.get_autocast_dtype("cpu"))
        head_dim = q.size(-1)
        grouped = enable_gqa and k.size(-3) != q.size(-3)
        if mask is None and q.dtype in _LOW and head_dim % 8 == 0 and head_dim <= 256 and q.dim() == 4:
            self._count("flash")
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale
            )[0]
        if not grouped and head_dim % 8 == 0 and q.dim() == 4:
            if mask is not None and mask.dtype == torch.bool:
                # what SDPA's convert_boolean_attn_mask does before the kernel
                mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
            if mask is not None:
                mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
            self._count("mem_efficient")
            need_lse = q.requires_grad or k.requires_grad or v.requires_grad
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, need_lse, dropout_p, is_causal, scale=scale
            )[0]
        # Grouped query heads outside flash (the memory-efficient kernel has no GQA), odd head
        # sizes: CUDA runs the math kernel. Called by name, because CPU's SDPA could pick its own
        # flash kernel here. (Its dropout, if any, keeps CPU's mask dtype: a small overestimate.)
        self._count("math")
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]
