"""SmolVLM2's processor without its video processor: transformers' SmolVLM image processor (its
PIL class) and the directory's tokenizer.

A SmolVLM2 directory (``model_type`` ``smolvlm``, as transformers saves it) names
``SmolVLMProcessor``, whose class wants a video processor (``SmolVLMVideoProcessor``: torch and
torchvision) and ``num2words`` (for videos' prompts) before it reads an image.  Images need
neither: the image processor sizes, splits and normalises them (numpy), and what each image's
``<image>`` becomes in the prompt is transformers' own ``get_image_prompt_string`` (the tiles'
``<fake_token_around_image><row_i_col_j>`` and ``image_seq_len`` image tokens, the global view's
``<global-img>``), with the processor's settings (``processor_config.json``'s
``image_seq_len``; the image processor's size, tiles and splitting) and the tokenizer's tokens,
as ``SmolVLMProcessor.__init__`` reads them.  The tower is Idefics3's (``families.Idefics3``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .families import Idefics3

__all__ = ["SmolVLM", "SmolVLMProcessor"]


class SmolVLMProcessor:
    """transformers' SmolVLM image processor (its PIL class), the directory's tokenizer, and what
    ``SmolVLMProcessor.replace_image_token`` writes for an image (that class needs torchvision)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer, SmolVLMImageProcessorPil

        settings = json.loads((path / "processor_config.json").read_text())
        self.images = SmolVLMImageProcessorPil.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # as SmolVLMProcessor.__init__ reads them: the tokenizer's, else SmolVLM's own
        self.fake_image_token = str(getattr(self.tokenizer, "fake_image_token", None) or "<fake_token_around_image>")
        self.image_token = str(getattr(self.tokenizer, "image_token", None) or "<image>")
        self.global_image_token = str(getattr(self.tokenizer, "global_image_token", None) or "<global-img>")
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
        self.image_seq_len = int(settings.get("image_seq_len", 169))  # SmolVLMProcessor's default

    def process(self, images: list[Any]) -> tuple[dict[str, Any], list[str]]:
        """The images' tiles (one sample: every image's, in order), their masks and grids, and
        what each image's placeholder becomes."""
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        inputs = dict(self.images([list(images)], return_row_col_info=True, return_tensors="np"))
        rows = [r for sample in inputs["rows"] for r in sample]
        cols = [c for sample in inputs["cols"] for c in sample]
        return inputs, [
            get_image_prompt_string(r, c, self.image_seq_len, fake_token_around_image=self.fake_image_token,
                                    image_token=self.image_token, global_image_token=self.global_image_token)
            for r, c in zip(rows, cols, strict=True)
        ]


class SmolVLM(Idefics3):
    """SmolVLM2's tower (Idefics3's SigLIP and pixel shuffle), its processor without video."""

    processor = SmolVLMProcessor
