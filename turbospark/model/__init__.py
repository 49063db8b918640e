"""The models themselves, synchronous and Trio-free: the batched engine protocol (``backend``), the
MLX engine (``mlx_backend`` with ``mlx_sampling``, ``prefix_cache``, ``mlx_load``) and the scripted
one, tokenizers and chat templates (``tokenizer``, ``tool_preamble``), reading a sequence's output
(``output``, ``sequence``, ``stops``), constraints (``constraint``), and the encoders (``encoder``,
``bert``), and the CPU kernels in a loaded model (``mlx_kernels``; decoder layers in 12 ops,
``mlx_blocks``; GGUF block tensors read through ggml, ``mlx_ggml``). Everything here runs on a
model's own thread (``threads/``). It may import ``errors``, ``kernels`` and the package's data;
never ``messages``, ``actors``, ``store`` or anything above."""
