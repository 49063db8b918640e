"""A diffusion pipeline's text encoder: Qwen3 (mlx-lm's layers) read as Z-Image reads it.

Z-Image conditions its transformer on a prompt the way Diffusers' ``ZImagePipeline`` writes it:
the prompt as one user turn through the tokenizer's chat template (``add_generation_prompt``,
``enable_thinking``), at most ``max_sequence_length`` tokens, and the hidden states *before the
last layer* (transformers' ``hidden_states[-2]``: the last layer and the final norm are never
run, and the last layer is never loaded).  Padding never reaches a real token (right padding under a causal
mask), so each prompt is encoded alone, at its own length, which is the same numbers.

The tokenizer is transformers' own (``AutoTokenizer``, already a dependency of mlx-lm), so the
template renders exactly as the reference's does.  Nothing here imports Trio.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.qwen3 import ModelArgs, Qwen3Model

from .widen import compute_dtype

__all__ = ["TextEncoder", "MAX_SEQUENCE_LENGTH"]

#: ZImagePipeline's default ``max_sequence_length``: longer prompts are cut there
MAX_SEQUENCE_LENGTH = 512


class TextEncoder:
    """``encode(prompt)``: the prompt's conditioning, ``[tokens, hidden_size]`` float32."""

    def __init__(self, encoder_dir: Path, tokenizer_dir: Path, dtype: mx.Dtype | None = None) -> None:
        from transformers import AutoTokenizer  # heavy: only once a pipeline loads

        config = json.loads((encoder_dir / "config.json").read_text())
        if config.get("model_type") != "qwen3":
            raise ValueError(f"the text encoder is a {config.get('model_type')!r} model; only 'qwen3' is supported")
        layers = int(config["num_hidden_layers"])
        if layers < 2:
            raise ValueError("the text encoder needs at least 2 layers (its states before the last are read)")
        args = ModelArgs.from_dict({**config, "num_hidden_layers": layers - 1, "tie_word_embeddings": True})
        self.model = Qwen3Model(args)
        weights: dict[str, mx.array] = {}
        for path in sorted(encoder_dir.glob("*.safetensors")):
            weights.update(mx.load(str(path)))
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        skip = (f"layers.{layers - 1}.", "lm_head.")  # the final norm is loaded (the model has one), never run
        weights = {k: v for k, v in weights.items() if not k.startswith(skip)}
        if dtype is not None:
            weights = {k: v.astype(dtype) for k, v in weights.items()}
        self.model.load_weights(list(weights.items()), strict=True)
        mx.eval(self.model.parameters())
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.hidden_size = args.hidden_size

    def tokens(self, prompt: str) -> list[int]:
        """The prompt's token ids, as the reference writes and cuts them."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=True,
        )  # fmt: skip
        ids = self.tokenizer(text, truncation=True, max_length=MAX_SEQUENCE_LENGTH)["input_ids"]
        return list(ids)

    def encode(self, prompt: str) -> mx.array:
        ids = mx.array(self.tokens(prompt))[None]
        h = self.model.embed_tokens(ids).astype(compute_dtype(self.model.layers[0].self_attn.q_proj))
        mask = "causal" if ids.shape[1] > 1 else None
        for layer in self.model.layers:
            h = layer(h, mask, None)
        return h[0].astype(mx.float32)
