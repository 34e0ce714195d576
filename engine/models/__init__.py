"""One module per architecture family; `model_class` picks the family of a config."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.models.llama import LlamaForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class for `cfg` (imported here, not at package import: the families
    import each other's layers)."""
    if cfg.is_mla:  # DeepSeek-V2/V3, dense or MoE
        from engine.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    if cfg.moe is not None:
        from engine.models.moe_model import MoeForCausalLM

        return MoeForCausalLM
    from engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
