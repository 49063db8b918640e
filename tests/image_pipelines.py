"""Tiny random Z-Image pipelines written by Diffusers (torch's CPU build), for the image tests.

``tiny_zimage(directory)`` builds a ``diffusers.ZImagePipeline`` at toy sizes (a 2-layer
transformer of width 64, a 2-layer Qwen3 text encoder of width 32, a 2-level VAE: 4 pixels per
latent, 8 per patch, so 64x64 images are 8x8 patches), randomises every parameter (so that no zero-
or one-initialised weight hides a bug) and saves it with ``save_pretrained``: the directory a user
would import.  The tokenizer is the package's ChatML BPE (SmolLM2's vocabulary) with Qwen3's
chat template (``enable_thinking``), saved as transformers writes one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import turbospark

TOKENIZER = Path(turbospark.__file__).parent / "model" / "data" / "chatml" / "tokenizer.json"
#: Qwen3's template, as far as one user turn and the generation prompt go
QWEN3_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
TRANSFORMER: dict[str, Any] = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 64, "n_layers": 2,
    "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 32,
    "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [8, 12, 12], "axes_lens": [1024, 64, 64],
}  # fmt: skip
VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
    "block_out_channels": [8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4,
    "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}  # fmt: skip
ENCODER: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
}  # fmt: skip
SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def _randomise(module: Any, torch: Any, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.ndim == 1 and not name.endswith("bias"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn_like(p) * fan_in**-0.5)
            else:
                p.copy_(0.05 * torch.randn_like(p))


def tiny_zimage(
    directory: Path, *, seed: int = 0, transformer: dict[str, Any] | None = None, vae: dict[str, Any] | None = None,
    encoder: dict[str, Any] | None = None, stored: str = "float32",
) -> Any:
    """Write a tiny random Z-Image pipeline to ``directory``; the Diffusers pipeline (float32).
    ``transformer``, ``vae``, ``encoder``: fields over the tiny ones (the benchmarks' real
    widths); ``stored``: the dtype of the files written (``"bfloat16"`` as Z-Image-Turbo ships)."""
    import diffusers
    import torch
    import transformers

    dit = diffusers.ZImageTransformer2DModel(**TRANSFORMER | (transformer or {}))
    autoencoder = diffusers.AutoencoderKL(**VAE | (vae or {}))
    qwen3 = transformers.Qwen3Model(transformers.Qwen3Config(**ENCODER | (encoder or {})))
    for i, module in enumerate((dit, autoencoder, qwen3)):
        _randomise(module, torch, seed * 10 + i)
        if stored != "float32":
            module.to(getattr(torch, stored))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), pad_token="<|endoftext|>", eos_token="<|im_end|>",
    )  # fmt: skip
    tokenizer.chat_template = QWEN3_TEMPLATE
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    pipe = diffusers.ZImagePipeline(
        scheduler=scheduler, vae=autoencoder.eval(), text_encoder=qwen3.eval(), tokenizer=tokenizer,
        transformer=dit.eval(),
    )  # fmt: skip
    pipe.save_pretrained(directory, safe_serialization=True)
    index = json.loads((directory / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline", index
    pipe.set_progress_bar_config(disable=True)
    return pipe
