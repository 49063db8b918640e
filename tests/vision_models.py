"""Tiny random vision-language models written by transformers (torch's CPU build), for the vision tests.

``tiny_idefics3(directory)`` builds an ``Idefics3ForConditionalGeneration`` (SmolVLM's layout) at toy
sizes: a 2-layer llama of width 64 over the package's ChatML BPE (SmolLM2's vocabulary, with
SmolVLM's image tokens added), and a 2-layer SigLIP tower of width 32 reading 32x32 tiles in 8x8
patches (16 patches, 4 image tokens a tile after the 2x2 pixel shuffle).  Images whose longest
edge passes 32 pixels are split into tiles, each with its ``<row_i_col_j>`` tag, before the
global view, as SmolVLM's processor does.  Every parameter is randomised (no zero- or
one-initialised weight hides a bug) and the model, its processor and its chat template are saved
with ``save_pretrained``: the directory a user would import.

``tiny_llava(directory)`` builds a ``LlavaForConditionalGeneration`` (LLaVA 1.5's layout): the same
llama over the same BPE (with ``<image>`` added), a 2-layer CLIP tower of width 32 reading a 32x32
crop in 8x8 patches, its second-to-last layer's patches (16 tokens, the class token dropped)
through the two-layer projector, as LLaVA 1.5 selects them.

``reference_generate`` runs transformers' own ``generate`` (greedy) on such a directory.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from .image_pipelines import TOKENIZER, _randomise


def png(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A PNG of random pixels, ``size`` (height, width), the same for the same seed."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def rgb(data: bytes) -> Any:
    """An image file as PIL's RGB image."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")

__all__ = ["GEMMA3_TEMPLATE", "IDEFICS3_TEMPLATE", "LLAVA_TEMPLATE", "MISTRAL3_TEMPLATE", "QWEN2_VL_TEMPLATE",
           "as_qwen_repository", "ask", "reference_generate", "run_jobs", "tiny_gemma3", "tiny_idefics3", "tiny_llava", "tiny_mistral3",
           "tiny_qwen2_vl", "tiny_smolvlm2"]

#: SmolVLM's chat template
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TEXT: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": False,
}  # fmt: skip
VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}  # fmt: skip
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


def _tokenizer(directory: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), bos_token="<|im_start|>", eos_token="<end_of_utterance>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    return tok


def tiny_idefics3(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random Idefics3 model and its processor, saved in ``directory`` as transformers
    writes them."""
    import torch
    from transformers import (
        Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor,
    )

    directory = Path(directory)
    tokenizer = _tokenizer(directory)
    vocab = len(tokenizer)
    config = Idefics3Config(
        text_config={"model_type": "llama", **TEXT, "vocab_size": vocab,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config=VISION, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(config).eval()
    _randomise(model, torch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True,
    )
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    processor.save_pretrained(directory)
    return directory


#: SmolVLM2's video processor config, in the shape its repositories ship (the class needs torch and
#: torchvision); its sizes are the tiny model's
SMOLVLM_VIDEO: dict[str, Any] = {
    "video_processor_type": "SmolVLMVideoProcessor", "processor_class": "SmolVLMProcessor", "do_convert_rgb": True,
    "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True, "do_sample_frames": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_image_size": {"longest_edge": 32},
    "resample": 1, "rescale_factor": 1 / 255, "size": {"longest_edge": 32}, "fps": 1, "num_frames": 64,
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 32}},
}  # fmt: skip


def tiny_smolvlm2(directory: Path, *, nested: bool = False, seed: int = 0) -> Path:
    """A tiny random SmolVLM2 model (``model_type`` ``smolvlm``: the same toy sizes and tokens as
    ``tiny_idefics3``), saved in ``directory`` as SmolVLM2's repositories hold it: the model by
    transformers' ``SmolVLMForConditionalGeneration``; ``processor_config.json`` naming
    ``SmolVLMProcessor``, ``preprocessor_config.json`` its ``SmolVLMImageProcessor`` and
    ``video_preprocessor_config.json`` its ``SmolVLMVideoProcessor`` (or, ``nested``, all three in
    ``processor_config.json``, as transformers 5's ``save_pretrained`` writes them); the chat
    template in ``chat_template.jinja``.  The processor's class is not what writes them: it wants
    its video processor, which needs torchvision."""
    import torch
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

    directory = Path(directory)
    tokenizer = _tokenizer(directory)
    config = SmolVLMConfig(
        text_config={"model_type": "llama", **TEXT, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config=VISION, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
    )
    model = SmolVLMForConditionalGeneration(config).eval()
    _randomise(model, torch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    images = SmolVLMImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True,
    )
    images.save_pretrained(directory)
    image_config = {**json.loads((directory / "preprocessor_config.json").read_text()),
                    "processor_class": "SmolVLMProcessor"}
    assert image_config["image_processor_type"] == "SmolVLMImageProcessor"
    processor: dict[str, Any] = {"image_seq_len": 4, "processor_class": "SmolVLMProcessor"}
    if nested:
        (directory / "preprocessor_config.json").unlink()
        processor = {"image_processor": image_config, "video_processor": SMOLVLM_VIDEO, **processor}
    else:
        (directory / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2))
        (directory / "video_preprocessor_config.json").write_text(json.dumps(SMOLVLM_VIDEO, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def _smolvlm_processor(directory: Path) -> Any:
    """transformers' ``SmolVLMProcessor`` for ``directory`` without its video processor (which needs
    torchvision) and without ``num2words`` (which only videos' prompts use)."""
    from unittest import mock

    import transformers
    from transformers import AutoTokenizer, SmolVLMImageProcessorPil
    from transformers.models.smolvlm import processing_smolvlm

    unchecked = type("SmolVLMProcessor", (transformers.SmolVLMProcessor,),
                     {"check_argument_for_proper_class": lambda *a: None})
    tokenizer = AutoTokenizer.from_pretrained(directory)
    settings = json.loads((Path(directory) / "processor_config.json").read_text())
    with mock.patch.object(processing_smolvlm, "num2words", processing_smolvlm.num2words or str):
        return unchecked(SmolVLMImageProcessorPil.from_pretrained(directory), tokenizer, None,
                         image_seq_len=settings["image_seq_len"], chat_template=tokenizer.chat_template)


#: A ChatML template that places each image part as ``<image>`` and a newline, as LLaVA's do
LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CLIP: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
    "image_size": 32, "patch_size": 8, "projection_dim": 32,
}  # fmt: skip


def tiny_llava(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA model and its processor, saved in ``directory`` as transformers writes them."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config = LlavaConfig(
        text_config={"model_type": "llama", **TEXT, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "clip_vision_model", **CLIP},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False,
    )
    model = LlavaForConditionalGeneration(config).eval()
    _randomise(model, torch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(images, tokenizer, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE).save_pretrained(directory)
    return directory


#: Gemma 3's chat template, shortened (no system turn, no tool calls): an image part is ``<start_of_image>``
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] | trim }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SIGLIP: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "image_size": 32, "patch_size": 8,
}  # fmt: skip


def tiny_gemma3(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random Gemma 3 model and its processor, saved in ``directory`` as transformers writes
    them: a 4-layer Gemma 3 text model of width 64 (a sliding window of 8 on three layers of four,
    which an image's 4 tokens fit) over the same BPE with Gemma's image tokens added, a 2-layer
    SigLIP tower reading 32x32 images in 8x8 patches, pooled 2x2 into 4 tokens."""
    import torch
    from transformers import (
        Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    directory = Path(directory)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), bos_token="<|im_start|>", eos_token="<end_of_turn>", pad_token="<|endoftext|>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")}
    config = Gemma3Config(
        text_config={"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                     "sliding_window_pattern": 4, "max_position_embeddings": 2048, "vocab_size": len(tokenizer),
                     "query_pre_attn_scalar": 16, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        vision_config={"model_type": "siglip_vision_model", **SIGLIP}, mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomise(model, torch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    Gemma3Processor(images, tokenizer, image_seq_length=4, chat_template=GEMMA3_TEMPLATE).save_pretrained(directory)
    return directory


#: Qwen2-VL's chat template, shortened (no default system turn, no tools): an image part is
#: ``<|vision_start|><|image_pad|><|vision_end|>``, which the processor expands
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen2_vl(directory: Path, *, version: str = "2", seed: int = 0) -> Path:
    """A tiny random Qwen2-VL (``version="2"``) or Qwen2.5-VL (``"2.5"``) model and its processor,
    saved in ``directory`` as transformers writes them: a 2-layer Qwen2 text model of width 64
    whose RoPE is multimodal (sections 2, 3, 3 of its 8 frequencies), over the same BPE with
    Qwen's vision tokens added; a 2-layer tower of width 32 reading 8x8 patches, two frames of
    each (an image is repeated in time), merged 2x2 into one token each.  A 40x48 image is resized
    to 32x48: 4x6 patches, 2x3 tokens.  Qwen2.5-VL's first layer attends within windows of 2x2
    tokens, its second over the whole image."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

    directory = Path(directory)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    text = {**TEXT, "vocab_size": len(tokenizer), "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if version == "2":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 8}
        config_class, model_class = "Qwen2VLConfig", "Qwen2VLForConditionalGeneration"
        processor_class = "Qwen2VLProcessor"
    else:
        vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                  "patch_size": 8, "window_size": 32, "fullatt_block_indexes": [1]}
        config_class, model_class = "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"
        processor_class = "Qwen2_5_VLProcessor"
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )
    model = getattr(transformers, model_class)(config).eval()
    _randomise(model, torch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      min_pixels=16 * 16, max_pixels=64 * 64)
    # as Qwen's repositories hold it, without the video processor (whose class needs torchvision)
    images.save_pretrained(directory)
    saved = json.loads((directory / "preprocessor_config.json").read_text())
    saved.update(image_processor_type="Qwen2VLImageProcessor", processor_class=processor_class)
    (directory / "preprocessor_config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def as_qwen_repository(source: Path, directory: Path) -> Path:
    """A copy of a ``tiny_qwen2_vl`` directory whose config.json is laid out as Qwen's own
    repositories lay it out (and mlx-vlm reads it): the language model's settings at the top,
    RoPE as ``rope_theta`` and an ``mrope`` ``rope_scaling``."""
    import shutil

    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    config["vision_config"].pop("model_type", None)
    config = {**text, **config, "rope_theta": rope["rope_theta"],
              "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _qwen_processor(directory: Path, name: str) -> Any:
    """transformers' Qwen2-VL processor without its video processor (which needs torchvision)."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    unchecked = type(name, (getattr(transformers, name),), {"check_argument_for_proper_class": lambda *a: None})
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return unchecked(Qwen2VLImageProcessorPil.from_pretrained(directory), tokenizer, None,
                     chat_template=tokenizer.chat_template)


#: Mistral's chat template, shortened (no system prompt, no tools): an image part is ``[IMG]``,
#: which the processor expands to the image's rows of ``[IMG]``, each ended by ``[IMG_BREAK]``
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}[/INST]{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)
PIXTRAL: dict[str, Any] = {
    "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 8, "hidden_act": "silu",
}  # fmt: skip  # silu, as Mistral's own checkpoints have it


def tiny_mistral3(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random Mistral 3 model and its processor, saved in ``directory`` as transformers
    writes them: a 2-layer Mistral text model of width 64 over the same BPE with Mistral's image
    and instruction tokens added, a 2-layer Pixtral tower of width 32 reading images of at most
    64 pixels a side in 8x8 patches (its RoPE by row and column), each 2x2 of patches merged into
    one token.  A 40x64 image is resized to 48x64: 3 rows of 4 tokens."""
    import torch
    from transformers import (
        Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil, PreTrainedTokenizerFast,
    )

    directory = Path(directory)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]})
    config = Mistral3Config(
        text_config={"model_type": "mistral", **TEXT, "vocab_size": len(tokenizer), "sliding_window": None,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
        vision_config=PIXTRAL, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    model = Mistral3ForConditionalGeneration(config).eval()
    _randomise(model, torch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    # as Mistral's repositories hold it (PixtralProcessor's class needs torchvision: not written by it)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size={"height": 8, "width": 8}).save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, indent=2))  # fmt: skip
    tokenizer.chat_template = MISTRAL3_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def _pixtral_inputs(directory: Path, messages: list[dict[str, Any]], images: list[Any]) -> dict[str, Any]:
    """What transformers' ``PixtralProcessor`` gives (its ``replace_image_token``, as written there),
    without the class, which needs torchvision."""
    from transformers import AutoTokenizer, PixtralImageProcessorPil

    settings = json.loads((directory / "processor_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out: dict[str, Any] = {}
    if images:
        step = settings["patch_size"] * settings["spatial_merge_size"]
        processed = PixtralImageProcessorPil.from_pretrained(directory)(images, patch_size=step, return_tensors="pt")
        parts = text.split("[IMG]")
        text = parts[0]
        for (height, width), rest in zip(processed["image_sizes"].tolist(), parts[1:], strict=True):
            rows = [["[IMG]"] * (width // step) + ["[IMG_BREAK]"]] * (height // step)
            tokens = [t for row in rows for t in row]
            tokens[-1] = "[IMG_END]"
            text += "".join(tokens) + rest
        out = {"pixel_values": processed["pixel_values"], "image_sizes": processed["image_sizes"]}
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    return {**ids, **out}


def reference_generate(directory: Path, messages: list[dict[str, Any]], images: list[Any], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` on the model in ``directory``: the new token ids."""
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText

    # the class by name: mlx-vlm, once imported, answers AutoProcessor with processors of its own
    directory = Path(directory)
    named = directory / "processor_config.json"
    name = json.loads((named if named.exists() else directory / "preprocessor_config.json").read_text())["processor_class"]
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    if name == "PixtralProcessor":
        inputs = _pixtral_inputs(directory, messages, images)
    elif name == "SmolVLMProcessor":  # its apply_chat_template asks the video processor for frames
        processor = _smolvlm_processor(directory)
        text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=text, images=images or None, return_tensors="pt")
    else:
        processor = (_qwen_processor(directory, name) if not named.exists()
                     else getattr(transformers, name).from_pretrained(directory))  # fmt: skip
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def ask(backend: Any, images: list[bytes], question: str, *, asked_first: bool = False) -> tuple[list[int], Any]:
    """A user message of ``images`` and ``question`` as a vision model's backend reads it: the
    prompt's ids, and what the tower made of the images (None without images)."""
    from turbospark.messages import ChatPrompt
    from turbospark.threads.prompt import render_prompt

    asked = {"type": "text", "text": question}
    content = [{"type": "image", "data": d} for d in images]
    content = [asked, *content] if asked_first else [*content, asked]
    seen = backend.vision.see(list(images)) if images else None
    ids, _ = render_prompt(backend.tokenizer, ChatPrompt(({"role": "user", "content": content},)),
                           expand=seen.expand if seen else str)  # fmt: skip
    if seen is not None:
        seen.keyed(ids)
    return ids, seen


def run_jobs(backend: Any, jobs: dict[int, tuple[list[int], Any]], new: int, steps: int = 300) -> dict[int, list[int]]:
    """Greedy decoding of ``jobs`` (sequence -> ``ask``'s answer) together on the model thread:
    each one's first ``new`` tokens (a step's accepted drafts included)."""
    from turbospark.model.backend import SamplingParams

    out: dict[int, list[int]] = {seq: [] for seq in jobs}
    for seq, (ids, seen) in jobs.items():
        backend.insert(seq, ids, SamplingParams(max_tokens=new, temperature=0.0), images=seen)
    for _ in range(steps):
        step = backend.step()
        for seq, token in step.tokens.items():
            out[seq] += [token, *step.more.get(seq, ())]
        for seq in [s for s in jobs if len(out[s]) >= new]:
            backend.remove(seq)
            del jobs[seq]
        if not jobs:
            break
    return {seq: tokens[:new] for seq, tokens in out.items()}
