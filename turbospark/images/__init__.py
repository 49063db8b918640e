"""Image generation: Z-Image pipelines in MLX and OpenAI's Images API on the wire.

The sans-io parts (no Trio, no MLX) are ``wire`` (the routes' checks, sizes, encoded images and
response bodies), ``schedule`` (the flow-matching schedule) and ``files`` (the images kept for
``response_format: url``).  The model is ``pipeline`` (``text_encoder``, ``zimage_dit``, ``vae``);
``worker`` is its pinned thread, the only code here that crosses into Trio; ``messages`` are what
the images actor, the threads and the routes send each other.  May import ``errors``,
``messages`` and ``turns.images`` (how every image a client sends is checked and decoded).
"""
