"""turbospark's CPU kernels for MLX: custom primitives in C++ (``src/``), built by ``scripts/setup``.

MLX's x86 CPU backend multiplies one row by a weight matrix through a general GEMM, and its
bfloat16 and quantized products are scalar and single-threaded.  The primitives here compute
``x @ W.T`` for the few rows of a decode step (and any rows for bfloat16, float16 and quantized
weights) with the weights read once per step, SIMD chosen at run time by the CPU's features
(AVX2 + FMA + F16C on x86-64; otherwise portable code, NEON on aarch64), over every core the
process is given (a job's chunks are taken as threads come, so Python, which builds the next
step's graph meanwhile, can take a core without holding the step up).  Quantized products round x to 8 bits per 32 values where the CPU has integer
dot products (AVX2), as llama.cpp's Q8_0 dot products do: 4-bit weights then cost about a third of
their float path at one row (decision 0028 measures what it costs in likelihood);
``TURBOSPARK_KERNELS_EXACT=1`` keeps x in float32.  They are MLX primitives, so they sit in MLX's graph like its own ops: lazy,
on the model thread's stream, in order with everything else.

For the decoder layers ``model/mlx_blocks`` fuses there are products with an RMSNorm prologue
and a residual or SwiGLU epilogue, q, k and v split into heads as views, attention written heads side by side, and a KV
cache's write in place (``kv_write``).

``serve_fast_ops`` puts one-op versions of ``mx.fast.rms_norm``, ``mx.fast.rope`` and
``mx.fast.scaled_dot_product_attention`` in place of MLX's own for arrays on the CPU, where MLX
builds each from a graph of 6 to 20 small ops (about 3.5-5 us each to dispatch); every model's
layers call them there, whatever its architecture or RoPE scaling.  It also puts one in place of
``mx.logsumexp`` over a float32 last axis: the engine normalizes every step's logits with it,
over the whole vocabulary, and MLX's own takes its exp one value at a time (the same bits here,
eight at a time).  Anything else (a GPU stream,
an explicit ``stream=``, types or masks the kernels do not take) goes to MLX's own, and so does
everything on a thread inside ``mlx_own_ops`` (a comparison's reference, while a model is served
on another); ``fast_ops_restored`` puts back after a block what was in place before it.

The module is optional.  Where it was not built (no compiler, another platform), was built
against another MLX than the one running (the C++ API is internal; scripts/setup rebuilds it),
or a model runs on a GPU, MLX's own ops serve and ``describe()`` says why.  ``TURBOSPARK_KERNELS=off``
turns them off; ``TURBOSPARK_KERNELS_ISA`` picks another instruction set the CPU runs (the tests
run on each).

GGUF's other block types (K-quants, Q5, IQ) go through a pinned ggml's own CPU code, one library
per instruction set built by ``scripts/build-ggml`` and opened at run time (``blocks``, decision
0041).

Owns the C++ sources (``src/``), their CMake build, ``ops`` (loading ``_native``, the functions
the model code calls, ``serve_fast_ops``) and ``blocks`` (ggml's block products).  Imports nothing of turbospark; ``model`` and
``store`` import it.
"""
