"""Z-Image's diffusion transformer in MLX: Diffusers' ``ZImageTransformer2DModel``, text to image.

A single-stream DiT.  The image's 2x2 patches and the caption's features are each embedded and
refined alone (``noise_refiner`` blocks, modulated by the timestep, for the image;
``context_refiner`` blocks, unmodulated, for the caption), then joined per item, image first, and
run through ``n_layers`` modulated blocks; a modulated final layer turns the image tokens back
into patches.  Every attention rotates queries and keys by a 3D RoPE over (caption index or image
frame, row, column), split over the head dimension as ``axes_dims`` says.

Batching follows Diffusers token for token, so an item's output does not depend on its batch
(up to float rounding): each item's caption and image sequences are padded to a multiple of 32
with learned pad tokens (which every real token attends to, as in Diffusers), and the items'
different lengths are masked out of attention (a masked key gets exactly zero weight).

Not supported, and refused when the config asks for it: the Omni variant (``siglip_feat_dim``),
patch sizes other than one 2x2 x 1-frame embedder, ``n_kv_heads`` other than ``n_heads``, RoPE
over other than three axes.  Nor are controlnet residuals, LoRA scaling or several frames.

``load_transformer`` reads a Diffusers ``transformer/`` folder and renames its tensors strictly.
Nothing here imports Trio or torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .widen import compute_dtype

__all__ = ["ZImageDiT", "load_transformer"]

SEQ_MULTIPLE = 32  # Diffusers' SEQ_MULTI_OF: every item's token sequences are padded to this
ADALN_DIM = 256  # the timestep embedding's width (capped by ``dim``)
QK_NORM_EPS = 1e-5  # Diffusers builds the q/k RMSNorms with this, whatever ``norm_eps`` is

#: every config field this port reads, with Diffusers' defaults
_DEFAULTS: dict[str, Any] = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "siglip_feat_dim": None,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1024, 512, 512],
}


class _Config:
    """The checked config: any field this port does not implement is a ValueError naming it."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        name = config.get("_class_name", "ZImageTransformer2DModel")
        if name != "ZImageTransformer2DModel":
            raise ValueError(f"_class_name {name!r} is not a ZImageTransformer2DModel")
        # "_"-fields are Diffusers' bookkeeping (version, source path); anything else unknown
        # might change the math, so it is refused rather than ignored
        for key in config:
            if not key.startswith("_") and key not in _DEFAULTS:
                raise ValueError(f"unsupported config field {key!r}")
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
        if list(c["all_patch_size"]) != [2]:
            raise ValueError(f"all_patch_size {c['all_patch_size']!r} is not supported (only [2])")
        if list(c["all_f_patch_size"]) != [1]:
            raise ValueError(f"all_f_patch_size {c['all_f_patch_size']!r} is not supported (only [1])")
        if c["siglip_feat_dim"] is not None:
            raise ValueError("siglip_feat_dim: the Omni variant is not supported")
        if c["n_kv_heads"] != c["n_heads"]:
            raise ValueError("n_kv_heads must equal n_heads (Diffusers' attention has no grouped heads)")
        self.patch = 2
        self.in_channels = int(c["in_channels"])
        self.dim = int(c["dim"])
        self.layers = int(c["n_layers"])
        self.refiner_layers = int(c["n_refiner_layers"])
        self.heads = int(c["n_heads"])
        self.eps = float(c["norm_eps"])
        self.qk_norm = bool(c["qk_norm"])
        self.cap_dim = int(c["cap_feat_dim"])
        self.theta = float(c["rope_theta"])
        self.t_scale = float(c["t_scale"])
        self.axes_dims = [int(d) for d in c["axes_dims"]]
        self.axes_lens = [int(n) for n in c["axes_lens"]]
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.heads}")
        if len(self.axes_dims) != 3 or len(self.axes_lens) != 3:
            raise ValueError("axes_dims and axes_lens must have 3 entries (caption/frame, row, column)")
        if sum(self.axes_dims) != self.dim // self.heads or any(d % 2 for d in self.axes_dims):
            raise ValueError(f"axes_dims {self.axes_dims} must be even and sum to the head dim")


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Diffusers' RoPE: each consecutive pair (x[2i], x[2i+1]) is a complex number times
    exp(i·angle), in float32.  The angles come from 3D positions per token, which
    ``mx.fast.rope`` (one position per sequence index) cannot express, so it is written out."""
    pairs = x.astype(mx.float32).reshape(*x.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = mx.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class _Block(nn.Module):
    """``ZImageTransformerBlock``: sandwich-normed attention and SwiGLU, each scaled by
    ``1 + scale`` before and gated by ``tanh(gate)`` after when ``modulated``."""

    def __init__(self, c: _Config, modulated: bool) -> None:
        super().__init__()
        d, hd = c.dim, c.dim // c.heads
        self.heads = c.heads
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_k = nn.Linear(d, d, bias=False)
        self.to_v = nn.Linear(d, d, bias=False)
        self.to_out = nn.Linear(d, d, bias=False)
        if c.qk_norm:
            self.norm_q = nn.RMSNorm(hd, eps=QK_NORM_EPS)
            self.norm_k = nn.RMSNorm(hd, eps=QK_NORM_EPS)
        hidden = int(d / 3 * 8)  # Diffusers' own rounding of the SwiGLU width
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.attention_norm1 = nn.RMSNorm(d, eps=c.eps)
        self.attention_norm2 = nn.RMSNorm(d, eps=c.eps)
        self.ffn_norm1 = nn.RMSNorm(d, eps=c.eps)
        self.ffn_norm2 = nn.RMSNorm(d, eps=c.eps)
        if modulated:
            self.adaln = nn.Linear(min(d, ADALN_DIM), 4 * d)

    def _attend(self, x: mx.array, mask: mx.array | None, rope: tuple[mx.array, mx.array]) -> mx.array:
        b, n, d = x.shape
        q, k, v = (f(x).reshape(b, n, self.heads, -1) for f in (self.to_q, self.to_k, self.to_v))
        if "norm_q" in self:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
        return self.to_out(out.transpose(0, 2, 1, 3).reshape(b, n, d))

    def __call__(
        self, x: mx.array, mask: mx.array | None, rope: tuple[mx.array, mx.array], t: mx.array | None = None
    ) -> mx.array:
        if t is None:
            x = x + self.attention_norm2(self._attend(self.attention_norm1(x), mask, rope))
            h = self.ffn_norm1(x)
            return x + self.ffn_norm2(self.w2(nn.silu(self.w1(h)) * self.w3(h)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = mx.split(self.adaln(t)[:, None], 4, axis=-1)
        a = self._attend(self.attention_norm1(x) * (1.0 + scale_msa), mask, rope)
        x = x + mx.tanh(gate_msa) * self.attention_norm2(a)
        h = self.ffn_norm1(x) * (1.0 + scale_mlp)
        return x + mx.tanh(gate_mlp) * self.ffn_norm2(self.w2(nn.silu(self.w1(h)) * self.w3(h)))


class ZImageDiT(nn.Module):
    """The transformer.  ``in_channels``: the latents' channels; ``patch_size``: what the latent
    height and width must divide by."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        c = _Config(config)
        self.config = c
        self.in_channels = c.in_channels
        self.patch_size = c.patch
        d, adaln = c.dim, min(c.dim, ADALN_DIM)
        self.t_mlp1 = nn.Linear(256, 1024)  # Diffusers' TimestepEmbedder: 256 frequencies, 1024 wide
        self.t_mlp2 = nn.Linear(1024, adaln)
        self.x_embedder = nn.Linear(c.patch * c.patch * c.in_channels, d)
        self.cap_norm = nn.RMSNorm(c.cap_dim, eps=c.eps)
        self.cap_embedder = nn.Linear(c.cap_dim, d)
        self.x_pad_token = mx.zeros((1, d))
        self.cap_pad_token = mx.zeros((1, d))
        self.noise_refiner = [_Block(c, modulated=True) for _ in range(c.refiner_layers)]
        self.context_refiner = [_Block(c, modulated=False) for _ in range(c.refiner_layers)]
        self.layers = [_Block(c, modulated=True) for _ in range(c.layers)]
        self.final_adaln = nn.Linear(adaln, d)
        self.final_linear = nn.Linear(d, c.patch * c.patch * c.in_channels)

    def _timestep(self, t: mx.array, dtype: mx.Dtype) -> mx.array:
        half = 128
        freqs = mx.exp(-math.log(10000) * mx.arange(half, dtype=mx.float32) / half)
        args = (t.astype(mx.float32) * self.config.t_scale)[:, None] * freqs[None]
        emb = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(compute_dtype(self.t_mlp1))
        return self.t_mlp2(nn.silu(self.t_mlp1(emb))).astype(dtype)

    def _rope(self, positions: list[np.ndarray], length: int) -> tuple[mx.array, mx.array]:
        """cos and sin ``[B, length, 1, head_dim / 2]`` of each item's ``[n, 3]`` integer
        positions; rows past an item's own length are masked keys whose outputs are dropped, so
        they get angle 0.  The angle is position x frequency in float64, rounded to float32,
        as Diffusers' tables hold it."""
        c = self.config
        freqs = [1.0 / (c.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)) for d in c.axes_dims]
        angles = np.zeros((len(positions), length, sum(c.axes_dims) // 2), dtype=np.float32)
        for i, pos in enumerate(positions):
            for axis, n in enumerate(c.axes_lens):
                if pos[:, axis].max(initial=0) >= n:
                    raise ValueError(f"position {pos[:, axis].max()} is past axes_lens[{axis}] = {n}: "
                                     "the caption or image is too long for this model")
            parts = [np.outer(pos[:, a].astype(np.float64), f) for a, f in enumerate(freqs)]
            angles[i, : len(pos)] = np.concatenate(parts, axis=-1).astype(np.float32)
        return mx.array(np.cos(angles))[:, :, None], mx.array(np.sin(angles))[:, :, None]

    def __call__(self, latents: mx.array, t: mx.array, captions: Sequence[mx.array]) -> mx.array:
        """``latents`` ``[B, C, H, W]``, ``t`` ``[B]`` (the pipeline's ``(1000 - timestep) /
        1000``), ``captions`` B arrays ``[L_i, cap_feat_dim]``: the output ``[B, C, H, W]``
        float32 (Diffusers' output, before the pipeline negates it)."""
        c, p = self.config, self.patch_size
        b, ch, h, w = latents.shape
        if ch != c.in_channels or h % p or w % p:
            raise ValueError(
                f"latents {latents.shape} must be [B, {c.in_channels}, H, W], H and W multiples of {p}"
            )
        if len(captions) != b or t.shape != (b,):
            raise ValueError(f"{b} latents need {b} timesteps and {b} captions")
        if any(cap.ndim != 2 or cap.shape[0] == 0 or cap.shape[1] != c.cap_dim for cap in captions):
            raise ValueError(f"each caption must be [L >= 1, {c.cap_dim}]")
        dtype = compute_dtype(self.x_embedder)
        adaln = self._timestep(t, dtype)

        # each item's caption is padded to a multiple of 32; the batch to the longest of those
        cap_lens = [cap.shape[0] for cap in captions]
        cap_padded = [n + (-n) % SEQ_MULTIPLE for n in cap_lens]
        cap_max = max(cap_padded)
        ht, wt = h // p, w // p
        n_img = ht * wt
        x_len = n_img + (-n_img) % SEQ_MULTIPLE

        # positions: caption token j is (1 + j, 0, 0), its pad tokens included; the image starts
        # one past its item's padded caption; image pad tokens are (0, 0, 0)
        cap_pos, img_pos = [], []
        rows, cols = np.meshgrid(np.arange(ht), np.arange(wt), indexing="ij")
        for n in cap_padded:
            cap_pos.append(np.stack([np.arange(1, n + 1), np.zeros(n, int), np.zeros(n, int)], axis=-1))
            grid = np.stack([np.full(n_img, n + 1), rows.ravel(), cols.ravel()], axis=-1)
            img_pos.append(np.concatenate([grid, np.zeros((x_len - n_img, 3), int)]))
        x_rope = self._rope(img_pos, x_len)
        cap_rope = self._rope(cap_pos, cap_max)
        joint_pos = [np.concatenate([xp, cp]) for xp, cp in zip(img_pos, cap_pos)]
        joint_rope = self._rope(joint_pos, x_len + cap_max)

        # patchify as Diffusers does: a patch's features are ordered (row, column, channel)
        x = latents.astype(dtype).reshape(b, ch, ht, p, wt, p).transpose(0, 2, 4, 3, 5, 1)
        x = self.x_embedder(x.reshape(b, n_img, p * p * ch))
        pads = mx.broadcast_to(self.x_pad_token.astype(dtype), (b, x_len - n_img, c.dim))
        x = mx.concatenate([x, pads], axis=1)
        for layer in self.noise_refiner:  # all images are one size: no mask
            x = layer(x, None, x_rope, adaln)

        raw = mx.stack([mx.pad(cap.astype(dtype), [(0, cap_max - cap.shape[0]), (0, 0)]) for cap in captions])
        real = mx.array(np.arange(cap_max)[None] < np.array(cap_lens)[:, None])[..., None]
        cap = mx.where(real, self.cap_embedder(self.cap_norm(raw)), self.cap_pad_token.astype(dtype))
        keys = np.arange(cap_max)[None] < np.array(cap_padded)[:, None]
        same = len(set(cap_padded)) == 1
        cap_mask = None if same else mx.array(keys)[:, None, None, :]
        for layer in self.context_refiner:
            cap = layer(cap, cap_mask, cap_rope)

        # one sequence per item: its image, then its caption (with its pad tokens); the rows past
        # an item's caption hold the refiner's outputs for masked rows, which nothing attends to
        joint = mx.concatenate([x, cap], axis=1)
        joint_keys = np.concatenate([np.ones((b, x_len), bool), keys], axis=1)
        joint_mask = None if same else mx.array(joint_keys)[:, None, None, :]
        for layer in self.layers:
            joint = layer(joint, joint_mask, joint_rope, adaln)

        scale = 1.0 + self.final_adaln(nn.silu(adaln))
        out = self.final_linear(mx.fast.layer_norm(joint[:, :n_img], None, None, 1e-6) * scale[:, None])
        out = out.reshape(b, ht, wt, p, p, ch).transpose(0, 5, 1, 3, 2, 4).reshape(b, ch, h, w)
        return out.astype(mx.float32)


#: this module's parameter-name prefixes -> Diffusers' (first match wins)
_PREFIXES = [
    ("x_embedder.", "all_x_embedder.2-1."),
    ("final_linear.", "all_final_layer.2-1.linear."),
    ("final_adaln.", "all_final_layer.2-1.adaLN_modulation.1."),
    ("t_mlp1.", "t_embedder.mlp.0."),
    ("t_mlp2.", "t_embedder.mlp.2."),
    ("cap_norm.", "cap_embedder.0."),
    ("cap_embedder.", "cap_embedder.1."),
]
_IN_BLOCK = [
    ("to_out.", "attention.to_out.0."),
    ("to_", "attention.to_"),
    ("norm_", "attention.norm_"),
    ("w", "feed_forward.w"),
    ("adaln.", "adaLN_modulation.0."),
]


def _diffusers_name(name: str) -> str:
    for ours, theirs in _PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    head, _, rest = name.partition(".")
    if head in ("noise_refiner", "context_refiner", "layers"):
        index, _, inner = rest.partition(".")
        for ours, theirs in _IN_BLOCK:
            if inner.startswith(ours):
                inner = theirs + inner[len(ours):]
                break
        return f"{head}.{index}.{inner}"
    return name  # the pad tokens keep their names


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    single = directory / "diffusion_pytorch_model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no diffusion_pytorch_model.safetensors (or its index) in {directory}")


def load_transformer(directory: Path, dtype: mx.Dtype | None = None) -> ZImageDiT:
    """The transformer stored in a Diffusers ``transformer/`` folder, its tensors cast to
    ``dtype`` (None: as stored).  A tensor missing from the files, or one the model does not
    have, is a ValueError naming it (by Diffusers' name)."""
    directory = Path(directory)
    model = ZImageDiT(json.loads((directory / "config.json").read_text()))
    stored: dict[str, mx.array] = {}
    for path in _weight_files(directory):
        for name, value in mx.load(str(path)).items():
            if name in stored:
                raise ValueError(f"tensor {name!r} is stored twice in {directory}")
            stored[name] = value
    ours = {_diffusers_name(name): name for name, _ in tree_flatten(model.parameters())}
    unexpected = sorted(set(stored) - set(ours))
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in {directory} ({len(unexpected)} in all)")
    missing = sorted(set(ours) - set(stored))
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in {directory} ({len(missing)} in all)")
    weights = [(ours[k], v if dtype is None else v.astype(dtype)) for k, v in stored.items()]
    model.load_weights(weights, strict=True)  # also checks every shape
    mx.eval(model.parameters())
    return model
