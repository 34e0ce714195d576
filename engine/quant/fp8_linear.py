"""A linear layer with float8_e4m3fn weights, and how it computes at each batch size.

Weights [N, K] with float32 scales [N, G] that multiply them (G = 1: per channel, a
per-tensor scale repeated per row; G > 1: block-wise, each row holding its block's scale
for each of G column groups, so fusing q/k/v or gate/up rows and a TP rank's row cut keep
every scale with its rows).

* Up to WEIGHT_ONLY_MAX_ROWS rows (decode), and for weight-only schemes: x stays in the
  model's dtype and the FP8 weight is widened in registers (kernels/triton_fp8_weight_only),
  the cost being the weight's bytes.
* More rows (prefill, large decode batches): x is quantized per row (per row and group for
  block weights; by the checkpoint's input_scale for static schemes) and the product runs
  in FP8 (kernels/triton_fp8_gemm: cuBLAS row-wise scaled mm, or the block-scaled kernel).
  Up to SPLIT_GEMM_MAX_ROWS rows with one scale per row and per channel (decode batches),
  the Triton kernel split along K (kernels/triton_fp8_split_gemm) runs instead, and hands
  its partial sums to a reader that adds them (`partials`).
* On CPU the torch references run the same arithmetic (kernels/ref_fp8).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.fp8_input import Fp8Input
from engine.quant.scheme import Fp8Scheme
from engine.quant.weight_scale import mse_channel_quantize
from kernels import ref_fp8

# Rows up to which the weight-only kernel runs (and FP8 x FP8 above). The crossover is
# measured by bench/fp8_bench.py (its per-batch weight-only and FP8 x FP8 step times): on
# an H200, 8B dummy, context 512 (2026-12-04, with the weight-only partials read by the
# next kernel up to these rows), batch 32 took 4.68 ms weight-only against 5.23 FP8 x FP8,
# batch 64 7.12 against 5.99.
WEIGHT_ONLY_MAX_ROWS = 32
# Dynamic activation scales of per-channel/per-tensor weights: 0 = one per row (cuBLAS's
# row-wise scaled mm); g = one per row and g columns (the Triton block-scaled kernel,
# where g divides K; else one per row). On SmolLM2-135M at load (bf16, CPU) perplexity
# rose 4.2% with one scale per row and 2.0% with 64-column groups (bench/RESULTS.md);
# bench/fp8_bench.py times prefill both ways.
ACT_GROUP = 0
# Rows up to which (above WEIGHT_ONLY_MAX_ROWS) the FP8 x FP8 product of per-row x
# per-channel scales runs in the K-split Triton kernel, whose grid fills the GPU where
# cuBLAS's 128 x 128 tiles leave most SMs idle, and whose partials the next kernel adds
# (0: cuBLAS at every row count). On an H200, 8B dummy, context 512, graphed decode step
# (bench/fp8_bench.py --sections pdl, 2026-12-04): batch 32 5.09 ms against cuBLAS's 5.44
# (weight-only is faster still there), batch 64 5.90 against 5.98, but batch 128 8.86
# against 7.36 (there cuBLAS's tiles already cover the GPU's rate better than this
# kernel's pointer-fed FP8 MMAs).
SPLIT_GEMM_MAX_ROWS = 64
# ... and up to this many rows for narrow layers only (out_features <= NARROW_OUT, as
# o_proj and down_proj of an 8B model): cuBLAS tiles their N = 4096 with 32 128 x 128 tiles,
# a quarter of an H200's SMs, where the K-split kernel's one wave covers them all. qkv_proj
# and gate_up_proj (48 and 224 column tiles) stay on cuBLAS. 0 turns it off (and
# SPLIT_GEMM_MAX_ROWS = 0 turns off both). On an H200 at
# 128 rows: o_proj 10.7 us against cuBLAS's 13.4, down_proj 32.0 against 36.6; the graphed
# 8B step 7.12 ms against 7.21 (batch 96: 6.30 against 6.46; bench/fp8_bench.py --sections
# gemm and pdl, 2026-12-04).
NARROW_SPLIT_MAX_ROWS = 128
NARROW_OUT = 4096
# Rows from GLU_MIN_ROWS to GLU_MAX_ROWS at which a [gate | up] layer's weight-only GEMV
# also applies silu(gate) * up in its epilogue (`silu_glu`): the MLP's activation launch and
# the [T, 2I] product's round trip through memory go. Measured on an H100, 8B dummy, graphed
# decode (bench/RESULTS.md, session 33): at 4 rows the step is 1.0-1.4% faster; at one row
# 1.7% slower (the one-row GEMV alone is near the HBM rate, and the fused one reads gate and
# up rows half the weight apart); 2 rows were not timed, so they stay unfused. 0 as the
# maximum turns it off (the benchmark's A/B).
GLU_MIN_ROWS = 3
GLU_MAX_ROWS = 4


def split_gemm_max_rows(out_features: int) -> int:
    """Rows up to which a layer of `out_features` outputs takes the K-split kernel (read at
    each call, so a bench can set the limits)."""
    if out_features <= NARROW_OUT and SPLIT_GEMM_MAX_ROWS > 0:
        return max(SPLIT_GEMM_MAX_ROWS, NARROW_SPLIT_MAX_ROWS)
    return SPLIT_GEMM_MAX_ROWS


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = scheme
        groups = 1
        if scheme.weight == "block" and scheme.block is not None:
            bk = scheme.block[1]
            groups = -(-in_features // bk)
            if in_features % bk and groups > 1:
                raise ValueError(f"quantization_config.weight_block_size: {bk} does not divide "
                                 f"the input width {in_features}")
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=ref_fp8.FP8,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, groups, dtype=torch.float32,
                                                    device=device), requires_grad=False)
        # static per-tensor activation scale; the loader keeps the largest of fused parts'
        self.input_scale = (nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device),
                                         requires_grad=False)
                            if scheme.act == "tensor" else None)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, weight={self.scheme.weight}, "
                f"act={self.scheme.act}, groups={self.groups}")

    def weight_only(self, rows: int) -> bool:
        return self.scheme.act == "none" or rows <= WEIGHT_ONLY_MAX_ROWS

    def takes_fp8_input(self, rows: int) -> bool:
        """Whether this layer quantizes `rows` rows of input one scale per row itself (FP8 x
        FP8 with per-channel weights and dynamic activations), so that an Fp8Input made by
        the kernel before it can stand in (engine/quant/fp8_input.py)."""
        return (not self.weight_only(rows) and self.input_scale is None and self.groups == 1
                and self.act_groups() == 1)

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        if isinstance(x, Fp8Input):
            return self._from_fp8_input(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.weight_only(x2.shape[0]):
            y = self._weight_only(x2)
        else:
            y = self._fp8_gemm(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def split_gemm(self, rows: int) -> bool:
        """Whether `rows` rows take the K-split FP8 x FP8 kernel."""
        return (WEIGHT_ONLY_MAX_ROWS < rows <= split_gemm_max_rows(self.out_features)
                and self.groups == 1
                and not self.weight_only(rows) and self.act_groups() == 1)

    def partials(self, x: torch.Tensor | Fp8Input) -> torch.Tensor | None:
        """[S, T, N] float32 K-split partial sums of the product, for a reader that adds
        them (engine/models/split_k.py); None where this layer does not make them."""
        if not x.is_cuda or self.bias is not None:
            return None
        if self.split_gemm(x.shape[0]):
            return self._split_gemm(x, partials=True)
        if isinstance(x, Fp8Input):
            return None
        if not self.weight_only(x.shape[0]):
            return None
        from kernels.triton_fp8_weight_only import auto_splits, fp8_weight_only

        s = auto_splits(x, self.out_features, self.groups)
        if s == 1:
            return None
        return fp8_weight_only(x, self.weight, self.weight_scale, splits=s)

    def silu_glu(self, x: torch.Tensor | Fp8Input) -> torch.Tensor | None:
        """silu(gate) * up, [T, N / 2], where this layer is an MLP's [gate | up] projection
        and the GEMV computes it whole (kernels/triton_fp8_weight_only.fp8_weight_only_glu:
        the same bits as the activation kernel over this layer's output); None where it
        does not (CPU, a bias, rows outside GLU_MIN_ROWS..GLU_MAX_ROWS, a grid that splits
        K)."""
        if (isinstance(x, Fp8Input) or not x.is_cuda or self.bias is not None or x.dim() != 2
                or not GLU_MIN_ROWS <= x.shape[0] <= GLU_MAX_ROWS
                or not self.weight_only(x.shape[0])
                or x.stride(1) != 1):
            return None
        from kernels.triton_fp8_weight_only import auto_glu_config, fp8_weight_only_glu

        cfg = auto_glu_config(x, self.out_features, self.groups)
        if cfg is None:
            return None
        return fp8_weight_only_glu(x, self.weight, self.weight_scale, config=cfg)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return ref_fp8.fp8_weight_only_ref(x, self.weight, self.weight_scale)
        from kernels.triton_fp8_weight_only import auto_splits, fp8_weight_only

        s = auto_splits(x, self.out_features, self.groups)
        y = fp8_weight_only(x, self.weight, self.weight_scale, splits=s)
        return y if s == 1 else y.sum(0).to(x.dtype)

    def act_groups(self) -> int:
        """Scale groups per row of the quantized input (the weight's, for block weights)."""
        if self.groups > 1 or not ACT_GROUP or self.in_features % ACT_GROUP:
            return self.groups
        return self.in_features // ACT_GROUP

    def _quantize_input(self, x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is not None:
            return ref_fp8.quant_static(x, self.input_scale)
        if not x.is_cuda:
            return ref_fp8.quant_rows(x, groups)
        from kernels.triton_fp8_gemm import quant_rows

        return quant_rows(x, groups)

    def _split_gemm(self, x: torch.Tensor | Fp8Input, partials: bool) -> torch.Tensor | None:
        """The K-split kernel's product: partials [S, T, N] float32 (None where it would not
        split), or [T, N] in x's dtype."""
        from kernels.triton_fp8_split_gemm import auto_splits, fp8_split_gemm

        s = auto_splits(x.q if isinstance(x, Fp8Input) else x, self.out_features)
        if partials and s == 1:
            return None
        xq, xs = (x.q, x.scale) if isinstance(x, Fp8Input) else self._quantize_input(x, 1)
        y = fp8_split_gemm(xq, xs, self.weight, self.weight_scale, s, x.dtype)
        if s == 1 or partials:
            return y
        return y.sum(0).to(x.dtype)  # no reader adds them: two more launches

    def _from_fp8_input(self, x: Fp8Input) -> torch.Tensor:
        """The product of an input quantized by the kernel that made it."""
        if not self.takes_fp8_input(x.shape[0]):
            raise ValueError(f"{self.extra_repr()}: an FP8-quantized input of {x.shape[0]} "
                             "rows, which this layer would not quantize one scale per row")
        y: torch.Tensor | None
        if not x.is_cuda:
            y = ref_fp8.fp8_gemm_ref(x.q, x.scale, self.weight, self.weight_scale, x.dtype)
        elif self.split_gemm(x.shape[0]):
            y = self._split_gemm(x, partials=False)
        else:
            from kernels.triton_fp8_gemm import fp8_gemm

            y = fp8_gemm(x.q, x.scale, self.weight, self.weight_scale, x.dtype)
        assert y is not None  # _split_gemm gives None only when asked for partials
        return y if self.bias is None else y + self.bias

    def _fp8_gemm(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.split_gemm(x.shape[0]):
            y = self._split_gemm(x, partials=False)
            assert y is not None
            return y
        groups = 1 if self.input_scale is not None else self.act_groups()
        xq, xs = self._quantize_input(x, groups)
        w_scale: torch.Tensor = self.weight_scale
        if groups != self.groups:  # per-channel weight scales, grouped activation scales
            w_scale = w_scale.expand(self.out_features, groups)
        if not x.is_cuda:
            return ref_fp8.fp8_gemm_ref(xq, xs, self.weight, w_scale, x.dtype)
        from kernels.triton_fp8_gemm import fp8_gemm

        return fp8_gemm(xq, xs, self.weight, w_scale, x.dtype)

    @staticmethod
    def from_float(layer: nn.Linear, scheme: Fp8Scheme) -> Fp8Linear:
        """`layer`'s weight quantized by `scheme` (per-channel or block scales)."""
        w = layer.weight.detach()
        out = Fp8Linear(layer.in_features, layer.out_features, layer.bias is not None, scheme,
                        device=w.device, dtype=w.dtype)
        strategy = "channel" if scheme.weight == "tensor" else scheme.weight
        if strategy == "channel" and scheme.weight_scales == "mse":
            q, scale = mse_channel_quantize(w)
        else:
            q, scale = ref_fp8.quantize_weight(w, strategy, scheme.block)
        with torch.no_grad():
            out.weight.copy_(q)
            out.weight_scale.copy_(rows_scale(scale, out.weight_scale.shape, scheme))
            if layer.bias is not None and out.bias is not None:
                out.bias.copy_(layer.bias)
        return out


def rows_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...],
               scheme: Fp8Scheme) -> torch.Tensor:
    """A checkpoint's scale tensor ([], [1], [N, 1], [N], or block [ceil(N/bn), G]) as the
    [N, G] per-row form Fp8Linear holds, for `shape` = (N, G)."""
    n, g = shape
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, g)
    if scheme.weight == "block" and scheme.block is not None:
        if s.dim() != 2 or s.shape[1] != g:
            raise ValueError(f"weight_scale_inv: expected [{-(-n // scheme.block[0])}, {g}], "
                             f"got {tuple(s.shape)}")
        full = s.repeat_interleave(scheme.block[0], dim=0)
        if full.shape[0] < n:
            raise ValueError(f"weight_scale_inv: {s.shape[0]} block rows cover "
                             f"{full.shape[0]} of {n} weight rows")
        return full[:n]
    s = s.reshape(-1, 1)
    if s.shape[0] != n:
        raise ValueError(f"weight_scale: expected {n} rows (one per output channel), got "
                         f"{s.shape[0]}")
    return s.expand(n, g)
