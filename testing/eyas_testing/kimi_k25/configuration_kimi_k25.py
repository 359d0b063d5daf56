"""The config of a Kimi-K2.5-shaped multimodal wrapper (remote code of eyas's fixture target).

`text_config` is a DeepseekV3 config (the language model); `vision_config` sizes the placeholder vision
tower and projector, which only make the checkpoint's layout match K2.5's (`vision_tower.*`,
`mm_projector.*`): the fixture never sees an image.
"""

from __future__ import annotations

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config: dict | DeepseekV3Config | None = None, vision_config: dict | None = None,
                 media_placeholder_token_id: int | None = None, **kwargs):
        if not isinstance(text_config, DeepseekV3Config):
            text_config = DeepseekV3Config(**(text_config or {}))
        self.text_config = text_config
        self.vision_config = {"hidden_size": 64, "patch_size": 14, "num_layers": 2, **(vision_config or {})}
        self.media_placeholder_token_id = media_placeholder_token_id
        kwargs.setdefault("tie_word_embeddings", text_config.tie_word_embeddings)
        super().__init__(**kwargs)
