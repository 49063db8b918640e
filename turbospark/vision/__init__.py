"""Vision: the towers that read images for vision-language models.

``tower`` builds a stored model's vision tower and projector (mlx-vlm's modules, its
``vision/`` directory) with transformers' image processor; ``families``, ``qwen`` and
``pixtral`` cut each family's tower into bounded pieces (``pieces``), and ``qwen`` places Qwen2-VL's image tokens in
its multimodal RoPE.  How a request's images are read on
the model thread, between decode steps, is ``model/mlx_vision.py``; how they arrive from each
API family is ``turns/images.py``; how a vision-language directory is stored is
``store/vision_import.py``.
"""
