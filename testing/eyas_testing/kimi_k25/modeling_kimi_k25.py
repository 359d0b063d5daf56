"""A Kimi-K2.5-shaped model (remote code of eyas's fixture target): `language_model` is a DeepseekV3
causal LM, beside a placeholder `vision_tower` and `mm_projector` with K2.5's weight prefixes.

Text in, logits out, exactly as the language model alone: the wrapper forwards every text argument to
it. The vision parts are never run; image inputs are refused by name.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class VisionBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class PlaceholderVisionTower(nn.Module):
    """Patch embedding and a few blocks: the layout of a vision encoder, not a trained one."""

    def __init__(self, cfg: dict):
        super().__init__()
        width, patch = cfg["hidden_size"], cfg["patch_size"]
        self.patch_embed = nn.Linear(3 * patch * patch, width)
        self.blocks = nn.ModuleList(VisionBlock(width) for _ in range(cfg["num_layers"]))
        self.final_layernorm = nn.LayerNorm(width)


class MultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int):
        super().__init__()
        self.pre_norm = nn.LayerNorm(vision_width)
        self.proj = nn.Sequential(nn.Linear(vision_width, text_width), nn.GELU(), nn.Linear(text_width, text_width))


class KimiK25ForConditionalGeneration(PreTrainedModel, GenerationMixin):
    config_class = KimiK25Config
    base_model_prefix = ""
    _no_split_modules = ["DeepseekV3DecoderLayer", "PlaceholderVisionTower", "MultiModalProjector"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _can_compile_fullgraph = False

    def __init__(self, config: KimiK25Config):
        super().__init__(config)
        self.vision_tower = PlaceholderVisionTower(config.vision_config)
        self.mm_projector = MultiModalProjector(config.vision_config["hidden_size"], config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        else:
            self.language_model._init_weights(module)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise ValueError("this Kimi-K2.5-shaped fixture has a placeholder vision tower: send text only")
        return self.language_model(input_ids=input_ids, **kwargs)
