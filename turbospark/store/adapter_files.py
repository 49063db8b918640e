"""LoRA and DoRA adapter files, read into what ``model/mlx_adapters.py`` puts beside a model's
layers (``serve --lora``).

- An mlx-lm adapter directory, as ``mlx_lm.lora`` writes it: ``adapter_config.json``
  (``fine_tune_type`` "lora" or "dora", ``lora_parameters.scale``) and ``adapters.safetensors``
  (``model.layers.N.self_attn.q_proj.lora_a`` of shape (in, rank), ``lora_b`` (rank, out), DoRA's
  ``m`` (out,)).  mlx-lm's own ``LoRALinear`` adds ``scale * (x @ lora_a) @ lora_b``.
- A GGUF LoRA, as llama.cpp's ``convert_lora_to_gguf.py`` writes it (``general.type`` "adapter",
  ``adapter.type`` "lora"): ``blk.N.attn_q.weight.lora_a`` and ``lora_b`` (PEFT's ``lora_A`` and
  ``lora_B``, the transposes of mlx-lm's), scaled by ``adapter.lora.alpha / rank`` as llama.cpp
  scales them; the rows of llama's Q and K undone from llama.cpp's RoPE order, as the model's own
  were at import (``gguf_tensors.unpermute``).

``Adapter.layers`` maps a module's path to ``(lora_a, lora_b * scale, m)`` in float32.  The
model thread reads them as it loads the model (``cli/attach.load_mlx``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..model.mlx_adapters import Adapter, AdapterError
from .blobs import is_gguf

__all__ = ["read_adapter", "read_adapters"]


def read_adapters(model: Path, given: Sequence[tuple[str, Path]]) -> list[Adapter]:
    """``given`` (name, path) adapters of the model stored at ``model``, then the one the model
    carries (a derived model's ``adapter/``, Ollama's ``ADAPTER``: ``store/derive.py``), named ""
    (it applies to every request that chooses none)."""
    carried = Path(model) / "adapter"
    if carried.is_dir():
        files = sorted(carried.glob("*.gguf"))
        given = [*given, ("", files[0] if files else carried)]
    if not given:
        return []
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        heads = (int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    except (OSError, ValueError, KeyError, TypeError):
        heads = None
    return [read_adapter(name, path, heads=heads) for name, path in given]


def read_adapter(name: str, path: Path, *, heads: tuple[int, int] | None = None) -> Adapter:
    """The adapter at ``path`` (an mlx-lm directory, or a GGUF LoRA file); ``heads``, the model's
    (query heads, key-value heads), for a GGUF LoRA of a llama-family model.

    Raises:
        AdapterError: it is neither, or is not whole.
    """
    path = Path(path)
    if path.is_dir() and (path / "adapter_config.json").is_file():
        return _mlx(name, path)
    if path.is_file() and is_gguf(path):  # by its magic bytes (an uploaded blob has no .gguf name)
        return _gguf(name, path, heads)
    raise AdapterError(f"adapter {name}: {path} is neither an mlx-lm adapter directory (adapter_config.json and "
                       "adapters.safetensors) nor a GGUF LoRA file")


def _mlx(name: str, path: Path) -> Adapter:
    import mlx.core as mx

    try:
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = mx.load(str(path / "adapters.safetensors"))
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {name}: cannot read {path}: {exc}") from None
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f'adapter {name}: a "{kind}" fine-tune is a model of its own, not an adapter: '
                           "import it with `models import`")
    try:
        scale = float(config["lora_parameters"]["scale"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"adapter {name}: adapter_config.json has no lora_parameters.scale") from None
    arrays = {key: np.array(value.astype(mx.float32)) for key, value in tensors.items()}
    layers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
    for key in arrays:
        if not key.endswith(".lora_a"):
            continue
        module = key[: -len(".lora_a")]
        a, b, m = arrays[key], arrays.get(f"{module}.lora_b"), arrays.get(f"{module}.m")
        if b is None or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(f"adapter {name}: {module} has no matching lora_a and lora_b (a LoRA of linear layers)")
        if kind == "dora" and m is None:
            raise AdapterError(f"adapter {name}: {module} has no DoRA magnitude (m)")
        layers[module] = (a, b * scale, m)
    if unknown := sorted(k for k in arrays if not k.endswith((".lora_a", ".lora_b", ".m"))):
        raise AdapterError(f"adapter {name}: {unknown[0]} is not a LoRA tensor")
    return _adapter(name, kind, layers)


def _gguf(name: str, path: Path, heads: tuple[int, int] | None) -> Adapter:
    from .gguf_architectures import ARCHITECTURES
    from .gguf_reader import GGUFFormatError, read_gguf
    from .gguf_tensors import dequantize, hf_name, unpermute

    try:
        gguf = read_gguf(path)
    except (OSError, GGUFFormatError) as exc:
        raise AdapterError(f"adapter {name}: cannot read {path}: {exc}") from None
    md = gguf.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
        raise AdapterError(f"adapter {name}: {path.name} is not a GGUF LoRA (general.type adapter, adapter.type lora)")
    arch_name = str(md.get("general.architecture", ""))
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise AdapterError(f"adapter {name}: a LoRA of a {arch_name or 'unnamed'} model, which turbospark does not read")
    alpha = float(md.get("adapter.lora.alpha", 0.0) or 0.0)
    tensors = {t.name: t for t in gguf}
    layers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
    for key, info in tensors.items():
        if not key.endswith(".lora_a"):
            continue
        stem = key[: -len(".lora_a")]
        hf = hf_name(stem, arch)
        other = tensors.get(f"{stem}.lora_b")
        if hf is None or other is None or not hf.endswith(".weight"):
            raise AdapterError(f"adapter {name}: {stem} is not a layer turbospark adapts (or has no lora_b)")
        a, b = dequantize(gguf, info).astype(np.float32), dequantize(gguf, other).astype(np.float32)  # (r, in), (out, r)
        if heads is not None and arch.unpermute_qk and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            b = unpermute(b, heads[0] if ".q_proj." in hf else heads[1])
        rank = a.shape[0]
        scale = alpha / rank if alpha else 1.0
        layers[hf[: -len(".weight")]] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T) * scale, None)
    return _adapter(name, "lora", layers)


def _adapter(name: str, kind: str, layers: dict[str, Any]) -> Adapter:
    if not layers:
        raise AdapterError(f"adapter {name}: it holds no LoRA layers")
    digest = hashlib.sha256()
    for module in sorted(layers):
        digest.update(module.encode())
        for array in layers[module]:
            if array is not None:
                digest.update(np.ascontiguousarray(array).tobytes())
    return Adapter(name, kind, layers, digest.hexdigest())
