"""Llama-family decoders whose MLP is a mixture of experts in some layers: Qwen3-MoE
(Qwen3's attention, q/k norm; `decoder_sparse_step` and `mlp_only_layers` pick the MoE
layers) and Mixtral (Mistral's attention; every layer MoE). Attention, norms, embedding and
head are the dense model's (engine/models/llama.py); `make_mlp` puts a SparseMoeBlock in
the layers `cfg.moe.layers` names, and loading stacks HF's per-expert tensors into it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.moe import ExpertName, SparseMoeBlock, full_param_to_local, parse_expert_name
from engine.parallel.dp_exchange import ExpertExchange
from engine.quant.fp8_moe import scale_reader

# HF module names of the MoE block, per family, mapped to ours ("mlp")
_BLOCK_ALIASES = (".block_sparse_moe.",)  # Mixtral
_SHARED_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _short(name: str) -> str:
    name = name.removeprefix("model.")
    for alias in _BLOCK_ALIASES:
        name = name.replace(alias, ".mlp.")
    return name


class MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module | None:
        moe = self.cfg.moe
        if moe is None or layer not in moe.layers:
            return None  # dense (Qwen3-MoE's mlp_only_layers and off-step layers)
        ep = self.ep_group
        if ep is not None:  # data-parallel attention: experts over every rank of the engine
            return SparseMoeBlock(moe, self.cfg.hidden_size, self.kernels, None, ep.rank,
                                  ep.size, ExpertExchange(ep, self.dp_step))
        return SparseMoeBlock(moe, self.cfg.hidden_size, self.kernels, self.group,
                              self.shard.rank, self.shard.size)

    def _expert_rank(self) -> tuple[int, int]:
        """(rank, size) the experts are split over: the engine's expert group under
        data-parallel attention, else the tensor-parallel group."""
        ep = self.ep_group
        return (ep.rank, ep.size) if ep is not None else (self.shard.rank, self.shard.size)

    def _block(self, path: str, name: str) -> SparseMoeBlock:
        try:
            block = self.get_submodule(path)
        except AttributeError:
            block = None
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"model: unexpected weight {name!r} in checkpoint (layer "
                             "has no mixture of experts)")
        return block

    def local_from_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if ".experts." in name or ".shared_experts." in name or ".mlp.gate." in name:
            return full_param_to_local(name, full, *self._expert_rank())
        return super().local_from_full(name, full)

    def wants(self, hf_name: str) -> tuple[int, int, int] | None:
        short = _short(hf_name)
        e = parse_expert_name(short)
        if e is not None:
            sh = self._block(e.block, hf_name).experts.shard
            if e.expert >= 0 and not sh.start <= e.expert < sh.start + sh.count:
                return 0, 0, 0  # another rank's expert: read nothing of it
            return None  # whole experts (a stacked tensor is cut at load)
        if ".shared_experts." in short or ".mlp.gate." in short:
            return None  # SharedExperts.load cuts its columns; the router is replicated
        return super().wants(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The dense model's loading, plus: router weights (and bias), shared experts, and
        routed experts, per expert or stacked, into this rank's stacks. A stack counts as
        loaded once every expert this rank holds got all its projections."""
        used: set[str] = set()
        got: dict[str, set[tuple[int, str]]] = {}  # block path -> (expert, proj) loaded

        def the_rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, w in weights:
                short = _short(name)
                e = parse_expert_name(short)
                if e is not None:
                    self._load_expert(e, name, w, got)
                    continue
                if ".shared_experts." in short:
                    path, _, leaf = short.partition(".shared_experts.")
                    block = self._block(path, name)
                    proj = _SHARED_PROJ.get(leaf.removesuffix(".weight"))
                    if block.shared_experts is None or proj is None:
                        raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
                    block.shared_experts.load(proj, w)
                    used.add(short)
                    continue
                if ".mlp.gate." in short:
                    path, _, leaf = short.partition(".mlp.gate.")
                    param = getattr(self._block(f"{path}.mlp", name).gate, leaf, None)
                    if not isinstance(param, nn.Parameter) or param.shape != w.shape:
                        raise ValueError(f"model: unexpected weight {name!r} with shape "
                                         f"{tuple(w.shape)} in checkpoint")
                    with torch.no_grad():
                        param.copy_(w.to(param.dtype))
                    used.add(short)
                    continue
                yield name, w

        used |= super().load_weights(the_rest())
        for path, pieces in got.items():
            sh = self._block(path, path).experts.shard
            mine = range(sh.start, sh.start + sh.count)
            for tail in ("", "_scale"):  # the weights, and an FP8 checkpoint's scales
                gu, g, u, d = (p + tail for p in ("gate_up", "gate", "up", "down"))
                if (-1, gu) in pieces or all(
                        (j, gu) in pieces or {(j, g), (j, u)} <= pieces for j in mine):
                    used.add(f"{path}.experts.w13{tail}")
                if (-1, d) in pieces or all((j, d) in pieces for j in mine):
                    used.add(f"{path}.experts.w2{tail}")
        return used

    def _load_expert(self, e: ExpertName, name: str, w: torch.Tensor,
                     got: dict[str, set[tuple[int, str]]]) -> None:
        block = self._block(e.block, name)
        if e.expert >= block.experts.num_experts:
            raise ValueError(f"model: weight {name!r} names expert {e.expert} of "
                             f"{block.experts.num_experts}")
        if e.tensor == "input_scale" and self.quant is not None:
            return  # the experts are weight-only: their activations are never quantized
        scale_of = None
        if e.tensor != "weight":
            if self.quant is None:
                raise ValueError(f"model: unexpected weight {name!r} in checkpoint (no "
                                 "quantization_config)")
            scale_of = scale_reader(self.quant, name)
        if block.experts.load_expert(e.expert, e.proj, w, scale_of):
            piece = e.proj if scale_of is None else f"{e.proj}_scale"
            got.setdefault(e.block, set()).add((e.expert, piece))
