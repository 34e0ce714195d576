"""Mixture-of-experts MLP shared by the MoE families (Qwen3-MoE, Mixtral, DeepSeek-V2/V3).

A layer routes each token to `top_k` of `E` experts (`select_experts`, exactly as
transformers computes it for each family), runs them as one fused kernel over stacked
weights (`MoE`, the kernel from the engine's KernelSet: Triton on CUDA, the torch reference
on CPU), and adds always-on shared experts where the model has them (`SparseMoeBlock`).
Once the weights are in (`SparseMoeBlock.finish_load`), one rank holding every expert
stacks the shared experts after the routed ones, and routing sends every token to them with
weight 1: the fused kernel then runs them, instead of a separate MLP and an add.

Tensor parallelism shards experts, not their columns: rank r of tp holds experts
[r * E / tp, (r + 1) * E / tp) whole, every rank routes every token (the router is
replicated), a rank computes only the (token, expert) pairs it holds, and the all-reduce
that follows the block sums the ranks' parts. Shared experts are column/row-parallel like
the dense MLP, and their partial sum joins the same all-reduce.

HF checkpoints store experts one by one (`experts.{j}.gate_proj/up_proj/down_proj`,
Mixtral `block_sparse_moe.experts.{j}.w1/w3/w2`) or, as transformers 5 holds them in
memory, stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]);
`parse_expert_name` + `MoE.load_expert` stack either form at load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import KernelSet
from engine.config import MoEConfig
from engine.models.moe_prefill import router_logits_fp32, shared_dense
from engine.parallel.dp_exchange import ExpertExchange
from engine.parallel.group import TPGroup
from engine.quant.fp8_input import wants_fp8_input
from kernels.ref_moe import moe_route_ref

if TYPE_CHECKING:  # llama.py's DecoderLayer calls forward_prenorm (it imports nothing here)
    from engine.models.llama import DecoderLayer, RMSNorm

TP_FLAG = "--tensor-parallel-size"
# Up to this many tokens (decode) the router's logits come from KernelSet.router_logits: one
# kernel where a float32 router was a cast, cuBLAS's float32 GEMV and its reduction per MoE
# layer; past it, the linear (a GEMM's launches amortized over its rows).
ROUTER_LOGITS_MAX_TOKENS = 16
# Within that bound, beside the Triton kernel set: the router's logits and the routing as
# one launch (kernels/triton_router_route.py) instead of two, a launch's fixed cost saved
# per MoE layer at decode. Off: no faster on an H100 (session 36, bench/RESULTS.md: even at
# V2-Lite's shape, 1.9% slower at Qwen3's; the last program's top-k waits on the others),
# `bench/moe_bench.py --variants "engine.models.moe.ROUTER_ROUTE_FUSED=True"`.
ROUTER_ROUTE_FUSED = False
# Where that fused launch runs: the decoder layer's post-attention residual add + RMSNorm
# inside it too (kernels/triton_router_route.router_route_prenorm), the norm's launch saved
# per MoE layer (SparseMoeBlock.forward_prenorm). Off: on an H100 (session 36) 1.2% slower
# at V2-Lite's shape, even at Qwen3's, 0.7% faster at V2-Lite's batch 8; `bench/
# moe_bench.py --variants "engine.models.moe.ROUTER_ROUTE_FUSED=True,engine.models.moe.
# ROUTER_PRENORM=True"`.
ROUTER_PRENORM = False
# At one token, where the routed experts' down projection and top-k sum are one launch
# (kernels.triton_moe.DOWN_SUM_MAX_TOKENS), the norm after the MoE block (the next decoder
# layer's input_layernorm, or the model's final norm) inside that launch too
# (kernels/triton_moe_down_sum.py's next_norm; SparseMoeBlock.forward_next_norm), the
# norm's launch saved per MoE layer. Off: on an H100 (session 36) down + sum with it was
# 12% slower than without at V2-Lite's shape and 9% at Qwen3's; `bench/
# moe_bench.py --variants "kernels.triton_moe.DOWN_SUM_MAX_TOKENS=1,engine.models.moe.
# NEXT_NORM_FUSED=True"` (the launch runs at the norm's warps: what that costs the weight
# stream is what the A/B measures).
NEXT_NORM_FUSED = False
# From this many tokens (a prefill) the folded shared experts run as dense GEMMs (cuBLAS)
# beside the routed ones, not as rows of the fused kernel: every token reads them, so they
# are a full-height GEMM, which cuBLAS runs faster than the grouped kernel's tiles; at
# decode, one kernel for both saves launches. None: always folded. The stacked weights
# serve both (engine/models/moe_prefill.shared_dense).
SHARED_DENSE_MIN_TOKENS: int | None = 1024


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                   renormalize: bool, n_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: torch.Tensor | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64).

    softmax: Qwen3-MoE (renormalize = norm_topk_prob), Mixtral (renormalize=True),
    DeepSeek-V2 (greedy; with n_group/topk_group its group_limited_greedy: a group scores
    its best expert, experts outside the best topk_group groups score 0).
    sigmoid: DeepSeek-V3 (noaux_tc): the bias is added to the scores for the choice only, a
    group scores the sum of its two best biased scores, experts outside the chosen groups
    are never picked, and the weights are the unbiased scores of the picks.
    The routed scaling factor multiplies the weights last (after renormalization)."""
    return moe_route_ref(router_logits, top_k, scoring_func, renormalize,
                         routed_scaling_factor, e_score_correction_bias, n_group=n_group,
                         topk_group=topk_group)


@dataclass(frozen=True)
class ExpertShard:
    """The experts one tensor-parallel rank holds."""

    start: int  # first global expert id on this rank
    count: int  # experts on this rank (E / tp)


def expert_shard(num_experts: int, rank: int, size: int) -> ExpertShard:
    if num_experts % size:
        raise ValueError(f"{TP_FLAG}: {size} does not divide the model's {num_experts} "
                         "experts")
    per = num_experts // size
    return ExpertShard(rank * per, per)


class MoE(nn.Module):
    """This rank's experts, stacked for the fused kernel; forward adds nothing for the
    (token, expert) pairs of other ranks and does not all-reduce (the block does, once)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, kernels: KernelSet,
                 rank: int = 0, size: int = 1) -> None:
        super().__init__()
        self.shard = expert_shard(num_experts, rank, size)
        self.num_experts, self.inter = num_experts, inter
        self.w13 = nn.Parameter(torch.empty(self.shard.count, 2 * inter, hidden))  # [El, 2I, H]
        self.w2 = nn.Parameter(torch.empty(self.shard.count, hidden, inter))  # [El, H, I]
        # FP8 experts (engine/quant/fp8_moe.py): float8_e4m3fn w13/w2 and their float32
        # per-row scales [El, 2I, G13] / [El, H, G2]; None while the experts are float
        self.w13_scale: nn.Parameter | None
        self.w2_scale: nn.Parameter | None
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        self.k = kernels

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] float32, topk_ids [T, k] global ids -> [T, H]."""
        assert self.k.fused_moe is not None, "kernels_for sets fused_moe on every device"
        if self.w13_scale is not None:
            fp8: torch.Tensor = self.k.fused_moe(
                x, self.w13, self.w2, topk_weights, topk_ids, self.shard.start,
                w13_scale=self.w13_scale, w2_scale=self.w2_scale)
            return fp8
        out: torch.Tensor = self.k.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids,
                                             self.shard.start)
        return out

    def load_expert(self, expert: int, proj: str, w: torch.Tensor,
                    scale_of: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]
                    | None = None) -> bool:
        """Copies one HF expert tensor into the stack. expert: global id, or -1 for a
        stacked [E, ...] tensor; proj: "gate" | "up" | "down" | "gate_up". scale_of: the
        tensor is an FP8 weight's scale, and this maps it to the per-row form [N, G] of
        the part it scales (engine/quant/fp8_moe.py). Returns False for an expert another
        rank holds (the caller drops it)."""
        scaled = scale_of is not None
        w13, w2 = (self.w13_scale, self.w2_scale) if scaled else (self.w13, self.w2)
        if w13 is None or w2 is None:
            raise ValueError(f"model: expert {expert} {proj} has an FP8 scale, and the "
                             "checkpoint's quantization_config leaves the experts float")
        if expert < 0:  # stacked over all experts: keep this rank's
            if scaled:
                raise ValueError(f"model: stacked expert {proj} scales are not implemented "
                                 "(per-expert tensors are)")
            if w.shape[0] != self.num_experts:
                raise ValueError(f"model: stacked expert weight has {w.shape[0]} experts, "
                                 f"expected {self.num_experts}")
            w = w.narrow(0, self.shard.start, self.shard.count)
            dst = w2.data if proj == "down" else w13.data
        else:
            local = expert - self.shard.start
            if not 0 <= local < self.shard.count:
                return False
            i = self.inter
            dst = {"gate": w13.data[local, :i], "up": w13.data[local, i:],
                   "gate_up": w13.data[local], "down": w2.data[local]}[proj]
        if scale_of is not None:
            w = scale_of(w, (dst.shape[0], dst.shape[1]))
        if dst.shape != w.shape:
            raise ValueError(f"model: expert {expert} {proj} weight has shape "
                             f"{tuple(w.shape)}, expected {tuple(dst.shape)}")
        if not scaled and (dst.dtype == torch.float8_e4m3fn) != (w.dtype == torch.float8_e4m3fn):
            raise ValueError(f"model: expert {expert} {proj} weight is {w.dtype}, where the "
                             f"checkpoint's quantization_config makes the experts {dst.dtype}")
        with torch.no_grad():
            dst.copy_(w.to(dst.dtype))
        return True


# `<prefix>.experts.<j>.<proj>.weight` (per expert) or `<prefix>.experts.<proj>` (stacked)
_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                         r"\.(weight|weight_scale|weight_scale_inv|input_scale)$")
_STACKED = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)$")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down", "gate_up_proj": "gate_up"}


@dataclass(frozen=True)
class ExpertName:
    block: str  # the MoE block's module path, e.g. "layers.3.mlp"
    expert: int  # global expert id; -1: the tensor stacks every expert
    proj: str  # "gate" | "up" | "down" | "gate_up"
    # "weight", or an FP8 checkpoint's "weight_scale" | "weight_scale_inv" | "input_scale"
    tensor: str = "weight"


def parse_expert_name(name: str) -> ExpertName | None:
    """The expert an HF tensor name belongs to; None for any other tensor."""
    m = _PER_EXPERT.match(name)
    if m:
        return ExpertName(m.group(1), int(m.group(2)), _PROJ[m.group(3)], m.group(4))
    m = _STACKED.match(name)
    if m:
        return ExpertName(m.group(1), -1, _PROJ[m.group(2)])
    return None


class SharedExperts(nn.Module):
    """The always-on experts as one gated MLP, column/row-parallel over tp ranks; returns
    this rank's partial sum (the block's all-reduce adds the ranks)."""

    def __init__(self, hidden: int, inter: int, kernels: KernelSet, rank: int,
                 size: int) -> None:
        super().__init__()
        if inter % size:
            raise ValueError(f"{TP_FLAG}: {size} does not divide the shared experts' "
                             f"intermediate size {inter}")
        self.inter, self.start = inter // size, rank * (inter // size)
        self.gate_up_proj = nn.Linear(hidden, 2 * self.inter, bias=False)  # [2I/tp, H]
        self.down_proj = nn.Linear(self.inter, hidden, bias=False)  # [H, I/tp]
        self.k = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.k.silu_and_mul(self.gate_up_proj(x)))  # [T, H]

    def load(self, proj: str, w: torch.Tensor) -> None:
        """One HF tensor (proj: "gate" | "up" | "down"), whole or already this rank's."""
        i, a = self.inter, self.start
        dim = 1 if proj == "down" else 0
        if w.shape[dim] != i:  # whole: keep this rank's columns
            w = w.narrow(dim, a, i)
        dst = {"gate": self.gate_up_proj.weight.data[:i], "up": self.gate_up_proj.weight.data[i:],
               "down": self.down_proj.weight.data}[proj]
        if dst.shape != w.shape:
            raise ValueError(f"model: shared expert {proj} weight has shape {tuple(w.shape)}, "
                             f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(w.to(dst.dtype))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts): the MLP of an MoE decoder layer.
    Parameter names follow HF's: `gate.weight` [E, H] (the router), `gate.
    e_score_correction_bias` [E], `experts.w13` / `experts.w2` (stacked), `shared_experts.*`."""

    def __init__(self, moe: MoEConfig, hidden: int, kernels: KernelSet,
                 group: TPGroup | None, rank: int = 0, size: int = 1,
                 exchange: ExpertExchange | None = None) -> None:
        """exchange: under data-parallel attention, how every rank's tokens reach these
        experts and come back (group is then None: the exchange's reduce-scatter sums)."""
        super().__init__()
        self.cfg = moe
        self.group = group
        self.exchange = exchange
        self.k = kernels
        # DeepSeek routes in float32 whatever the model's dtype; the others in the model's
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False,
                              dtype=torch.float32 if moe.router_fp32 else None)
        if moe.score_bias:
            self.gate.register_parameter(
                "e_score_correction_bias",
                nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32),
                             requires_grad=False))
        self.experts = MoE(moe.num_experts, hidden, moe.intermediate_size, kernels, rank, size)
        self.shared_experts = (SharedExperts(hidden, moe.shared_intermediate_size, kernels,
                                             rank, size)
                               if moe.n_shared_experts else None)
        # shared experts stacked after the routed ones in `experts` (finish_load): every
        # token is routed to them too, with weight 1, so the fused kernel runs them
        self.folded_shared = 0

    def finish_load(self) -> None:
        """Stacks the shared experts after the routed ones once the weights are in, so a
        step runs one fused kernel instead of the fused kernel plus the shared MLP's two
        GEMMs, its activation and the add (four kernels a layer at decode). The shared MLP
        of width S * I is S experts of width I summed (the activation is per column).
        Kept apart where the stack cannot hold them: experts split over ranks (the extra
        ids would name another rank's experts), FP8 experts beside float shared ones, or
        a shared width that is not a whole number of experts."""
        sh, ex = self.shared_experts, self.experts
        if sh is None or self.exchange is not None or ex.shard.count != ex.num_experts:
            return
        gu, down = sh.gate_up_proj.weight, sh.down_proj.weight  # [2 S I, H], [H, S I]
        if ex.w13_scale is not None or gu.dtype != ex.w13.dtype or sh.inter % ex.inter:
            return
        s, i, h = sh.inter // ex.inter, ex.inter, gu.shape[1]
        with torch.no_grad():
            gate, up = gu.view(2, s, i, h).unbind(0)  # [S, I, H] each
            w13 = torch.cat([ex.w13, torch.cat([gate, up], dim=1)])  # [E + S, 2I, H]
            w2 = torch.cat([ex.w2, down.view(h, s, i).transpose(0, 1)])  # [E + S, H, I]
        ex.w13 = nn.Parameter(w13, requires_grad=False)
        ex.w2 = nn.Parameter(w2, requires_grad=False)
        self.shared_experts = None
        self.folded_shared = s

    def route(self, x: torch.Tensor, with_shared: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k + S] float32, topk_ids [T, k + S]); S: the
        shared experts folded into the stack (0 if none or not with_shared), weight 1
        each."""
        c = self.cfg
        w = self.gate.weight
        out_dtype, kw = self._route_args(x.dtype, with_shared)
        if self._fused_route(x.shape[0]):
            from kernels.triton_router_route import router_route
            return router_route(x, w, out_dtype, c.top_k, c.scoring_func, c.renormalize,
                                c.routed_scaling_factor, **kw)
        if self.k.router_logits is not None and x.shape[0] <= ROUTER_LOGITS_MAX_TOKENS:
            logits = self.k.router_logits(x, w, out_dtype)  # [T, E]: one kernel at decode
        elif c.router_fp32:
            logits = router_logits_fp32(self, x, w)
        else:
            logits = F.linear(x, w)
        route = self.k.moe_route if self.k.moe_route is not None else moe_route_ref
        out: tuple[torch.Tensor, torch.Tensor] = route(
            logits, c.top_k, c.scoring_func, c.renormalize, c.routed_scaling_factor, **kw)
        return out

    def _route_args(self, dtype: torch.dtype, with_shared: bool
                    ) -> tuple[torch.dtype, dict[str, Any]]:
        """The logits' dtype for a hidden state of `dtype`, and the routing's keyword
        arguments (moe_route's, router_route's)."""
        c = self.cfg
        return (torch.float32 if c.router_fp32 else dtype), dict(
            e_score_correction_bias=getattr(self.gate, "e_score_correction_bias", None),
            round_dtype=dtype if c.weights_in_model_dtype else None,
            num_shared=self.folded_shared if with_shared else 0, n_group=c.n_group,
            topk_group=c.topk_group)

    def _fused_route(self, tokens: int) -> bool:
        """Whether `tokens` route in one launch (kernels/triton_router_route.py): the two
        kernels it replaces are the Triton set's and run at this many tokens."""
        return (ROUTER_ROUTE_FUSED and self.k.name == "triton"
                and tokens <= ROUTER_LOGITS_MAX_TOKENS and self.k.router_logits is not None
                and self.k.moe_route is not None)

    def _dense(self, tokens: int) -> bool:
        """Whether the folded shared experts run as dense GEMMs at this many tokens."""
        return (self.folded_shared > 0 and SHARED_DENSE_MIN_TOKENS is not None
                and tokens >= SHARED_DENSE_MIN_TOKENS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], summed over the tensor-parallel ranks."""
        n = x.shape[0]
        if self.exchange is not None:
            x = self.exchange.dispatch(x)  # [ranks * m, H]: every rank's tokens
        dense = self._dense(x.shape[0])
        weights, ids = self.route(x, with_shared=not dense)
        return self._experts(x, weights, ids, dense, n)

    def forward_prenorm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                        after: DecoderLayer | RMSNorm | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """forward(h) after h, new_residual = norm(x, residual), with the norm inside the
        router's launch (ROUTER_PRENORM): (out, new_residual, False), or None where that
        does not apply and the caller runs the two. It applies where the fused routing does
        (_fused_route), to a plain norm of a [T, H] hidden state in the residual's dtype or
        of a K-split projection's [S, T, H] float32 partial sums (engine/models/split_k.py:
        Qwen3-MoE's o_proj at few rows; the launch adds them as rms_norm would), and not
        under data-parallel attention, whose exchange moves the tokens between the norm
        and the routing. after: what follows the decoder layer (DecoderLayer.forward's),
        whose norm runs in the experts' last launch where forward_next_norm would run it:
        the result is then that norm's (normed, its new residual, True)."""
        t = residual.shape[0]
        parts = x.dim() == 3 and x.dtype == torch.float32
        if (not ROUTER_PRENORM or self.exchange is not None or not self._fused_route(t)
                or norm.k.name != "triton"
                or not (parts or (x.dim() == 2 and residual.dtype == x.dtype))):
            return None
        from kernels.triton_router_route import router_route_prenorm

        c = self.cfg
        dense = self._dense(t)
        out_dtype, kw = self._route_args(residual.dtype, with_shared=not dense)
        weights, ids, h, new_residual = router_route_prenorm(
            x, residual, norm.weight, norm.eps, self.gate.weight, out_dtype, c.top_k,
            c.scoring_func, c.renormalize, c.routed_scaling_factor, **kw)
        then = self._next_norm(h, new_residual, after, dense)
        if then is not None:
            normed, next_residual = self._experts_next_norm(h, weights, ids, new_residual,
                                                            then)
            return normed, next_residual, True
        return self._experts(h, weights, ids, dense, t), new_residual, False

    def forward_next_norm(self, x: torch.Tensor, residual: torch.Tensor,
                          after: DecoderLayer | RMSNorm
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """norm(forward(x), residual) for `after`'s norm (the next layer's input_layernorm
        or the final norm), the norm inside the experts' last launch (NEXT_NORM_FUSED:
        kernels/triton_moe_down_sum.py's next_norm, where down and sum are one launch):
        (normed, new_residual), or None, having launched nothing, where that does not
        apply and the caller runs the two (_next_norm)."""
        if not NEXT_NORM_FUSED:  # decode's host asks this for every MoE layer of every step
            return None
        norm = self._next_norm(x, residual, after, self._dense(x.shape[0]))
        if norm is None:
            return None
        weights, ids = self.route(x)
        return self._experts_next_norm(x, weights, ids, residual, norm)

    def _next_norm(self, x: torch.Tensor, residual: torch.Tensor,
                   after: DecoderLayer | RMSNorm | None, dense: bool) -> RMSNorm | None:
        """after's norm where it may run in the experts' last launch, else None: the switch
        on, the Triton kernels for both, the block's output the experts' alone (no
        all-reduce or exchange after them, no shared experts added apart or densely), a
        [T, H] input in the residual's dtype, and the norm's output not quantized for its
        projection (RMSNorm's `into`, which the launch does not do), and down and sum one
        launch for the call (kernels.triton_moe.down_sum_applies: one token,
        DOWN_SUM_MAX_TOKENS). The switch first: decode's host runs this for every MoE
        layer of every step."""
        if not NEXT_NORM_FUSED or after is None:
            return None
        from kernels.triton_moe import down_sum_applies

        norm, into = after.as_next_norm()
        ex = self.experts
        ok = (not dense and self.group is None and self.exchange is None
              and self.shared_experts is None and self.k.name == "triton"
              and norm.k.name == "triton" and x.dim() == 2 and residual.dtype == x.dtype
              and (into is None or not wants_fp8_input(into, x.shape[0], norm.k.rms_norm_quant))
              and down_sum_applies(x, ex.w13, ex.w2, ex.w2_scale is not None))
        return norm if ok else None

    def _experts_next_norm(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           residual: torch.Tensor, norm: RMSNorm
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(experts(x), residual) with the norm in the experts' last launch, where
        _next_norm said it applies."""
        from kernels.triton_moe import fused_moe_next_norm

        ex = self.experts
        done = fused_moe_next_norm(x, ex.w13, ex.w2, weights, ids, ex.shard.start,
                                   norm.weight, norm.eps, residual, w13_scale=ex.w13_scale,
                                   w2_scale=ex.w2_scale)
        assert done is not None, "_next_norm checked down_sum_applies"
        return done

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 dense: bool, n: int) -> torch.Tensor:
        """Everything after the routing: the experts on x [T, H] (the normed hidden state),
        the shared ones not folded, and the sum over the ranks (or the exchange back to
        this rank's n tokens)."""
        out = self.experts(x, weights, ids)
        if dense:  # as HF's block: the routed sum, rounded, plus the shared MLP's output
            out = out + shared_dense(self, x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.exchange is not None:
            return self.exchange.combine(out, n)
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out


def full_param_to_local(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a TP1-shaped MoE block parameter (dummy weights draw TP1's
    tensors, then each rank keeps its slice, so every TP size runs the same model).
    name: the parameter's name relative to anything (matched by suffix)."""
    if size == 1:
        return full
    if name.endswith(("experts.w13", "experts.w2")):
        per = full.shape[0] // size
        return full.narrow(0, rank * per, per)
    if name.endswith("shared_experts.gate_up_proj.weight"):
        gate, up = full.chunk(2, dim=0)
        per = gate.shape[0] // size
        return torch.cat([gate.narrow(0, rank * per, per), up.narrow(0, rank * per, per)])
    if name.endswith("shared_experts.down_proj.weight"):
        per = full.shape[1] // size
        return full.narrow(1, rank * per, per)
    return full  # router weight and bias: replicated
