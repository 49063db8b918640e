"""Diffusers' ``AutoencoderKL`` in MLX: the image VAE of Z-Image and FLUX (and SD-style VAEs).

``decode`` turns latents into images and ``encode`` images into the latent distribution's mean
and log-variance, both NHWC.  The network is Diffusers' own: an ``Encoder`` of
``DownEncoderBlock2D``s and a ``Decoder`` of ``UpDecoderBlock2D``s, each around a mid-block of two
ResNet blocks with (``mid_block_add_attention``) one single-head self-attention between them,
GroupNorm (eps 1e-6) and SiLU throughout, and the optional 1x1 ``quant_conv`` /
``post_quant_conv`` of SD-style VAEs.  ``load_vae`` reads a pipeline's ``vae/`` folder, renaming
the checkpoint's tensors to this module's names and checking them strictly.

Not supported (refused, naming the field): other block types (attention or skip blocks), other
activations, the spatial norm of MoVQ-style decoders, ``latents_mean``/``latents_std``
normalisation, and every other ``AutoencoderKL*`` class (Wan, Qwen-Image, FLUX.2, ...).  Neither
tiling nor slicing is done: a decode is one graph.  Sampling from the posterior is the caller's.

Nothing here imports Trio or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["AutoencoderKL", "load_vae", "diffusers_to_mlx"]

_EPS = 1e-6  # Diffusers' Encoder and Decoder hard-code this for every norm
_WEIGHTS = "diffusion_pytorch_model.safetensors"
# config fields that do not change the forward pass (or are read by callers only)
_INERT = {"sample_size", "force_upcast", "scaling_factor", "shift_factor"}
_READ = {
    "in_channels", "out_channels", "down_block_types", "up_block_types", "block_out_channels",
    "layers_per_block", "act_fn", "latent_channels", "norm_num_groups", "use_quant_conv",
    "use_post_quant_conv", "mid_block_add_attention", "latents_mean", "latents_std",
}  # fmt: skip


class _GroupNorm(nn.Module):
    """PyTorch's GroupNorm (channel groups are contiguous) on NHWC.  The statistics are reductions
    over a free reshape, not ``nn.GroupNorm``'s two transposed copies: at 1024x1024 pixels a copy
    of the last decoder stage is half a gigabyte."""

    def __init__(self, groups: int, channels: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = mx.ones((channels,))
        self.bias = mx.zeros((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        b, h, w, c = x.shape
        g = x.reshape(b, h * w, self.groups, c // self.groups)
        # the statistics in float32 whatever the activations' dtype: a bf16 sum over a
        # million pixels would lose the mean
        f = g.astype(mx.float32)
        mean = f.mean(axis=(1, 3), keepdims=True)
        var = mx.var(f, axis=(1, 3), keepdims=True)
        # one multiply-add per element: weight and bias folded into the per-group scale and shift
        scale = mx.rsqrt(var + _EPS) * self.weight.reshape(self.groups, -1).astype(mx.float32)
        shift = self.bias.reshape(self.groups, -1).astype(mx.float32) - mean * scale
        return (g * scale + shift).astype(x.dtype).reshape(b, h, w, c)


class _Resnet(nn.Module):
    """``ResnetBlock2D`` without a time embedding (the VAE's only kind)."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = _GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.conv_shortcut = nn.Conv2d(cin, cout, 1)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.conv1(nn.silu(self.norm1(x)))
        h = self.conv2(nn.silu(self.norm2(h)))
        return (self.conv_shortcut(x) if "conv_shortcut" in self else x) + h


class _Attention(nn.Module):
    """The mid-block's ``Attention``: GroupNorm, one head as wide as the channels over every
    position, a residual.  The fused attention never holds the (h*w)^2 scores where the backend
    has a kernel for the head size; where it has none it is still one matrix at the latent's size."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = _GroupNorm(groups, channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.Linear(channels, channels)

    def __call__(self, x: mx.array) -> mx.array:
        b, h, w, c = x.shape
        t = self.group_norm(x).reshape(b, 1, h * w, c)
        q, k, v = self.to_q(t), self.to_k(t), self.to_v(t)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=c**-0.5)
        return x + self.to_out(a).reshape(b, h, w, c)


class _Mid(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = [_Resnet(channels, channels, groups), _Resnet(channels, channels, groups)]
        self.attentions = [_Attention(channels, groups)] if attention else []

    def __call__(self, x: mx.array) -> mx.array:
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        return self.resnets[1](x)


class _Down(nn.Module):
    """``Downsample2D`` with ``padding=0``: Diffusers pads right and bottom only, then a stride-2
    3x3 convolution (a symmetric pad would shift the image by half a pixel)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def __call__(self, x: mx.array) -> mx.array:
        return self.conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))


class _Up(nn.Module):
    """``Upsample2D``: nearest-neighbour doubling, then a 3x3 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def __call__(self, x: mx.array) -> mx.array:
        b, h, w, c = x.shape
        x = mx.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c)).reshape(b, 2 * h, 2 * w, c)
        return self.conv(x)


class _Block(nn.Module):
    """A ``DownEncoderBlock2D`` (``down``) or ``UpDecoderBlock2D`` (``up``): ResNet blocks, then
    the resampler unless it is the last block."""

    def __init__(self, cin: int, cout: int, layers: int, groups: int, resample: str | None) -> None:
        super().__init__()
        self.resnets = [_Resnet(cin if i == 0 else cout, cout, groups) for i in range(layers)]
        if resample == "down":
            self.downsamplers = [_Down(cout)]
        elif resample == "up":
            self.upsamplers = [_Up(cout)]

    def __call__(self, x: mx.array) -> mx.array:
        for resnet in self.resnets:
            x = resnet(x)
        for resampler in self.get("downsamplers", []) + self.get("upsamplers", []):
            x = resampler(x)
        return x


class _Encoder(nn.Module):
    def __init__(self, cin: int, latent: int, widths: list[int], layers: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(cin, widths[0], 3, padding=1)
        last = len(widths) - 1
        self.down_blocks = [
            _Block(widths[max(i - 1, 0)], w, layers, groups, None if i == last else "down") for i, w in enumerate(widths)
        ]
        self.mid_block = _Mid(widths[-1], groups, attention)
        self.conv_norm_out = _GroupNorm(groups, widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], 2 * latent, 3, padding=1)  # mean and log-variance

    def __call__(self, x: mx.array) -> mx.array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(nn.silu(self.conv_norm_out(x)))


class _Decoder(nn.Module):
    def __init__(self, latent: int, cout: int, widths: list[int], layers: int, groups: int, attention: bool) -> None:
        super().__init__()
        rev = widths[::-1]
        self.conv_in = nn.Conv2d(latent, rev[0], 3, padding=1)
        self.mid_block = _Mid(rev[0], groups, attention)
        last = len(rev) - 1
        # one ResNet block more per stage than the encoder has: Diffusers' Decoder does so
        self.up_blocks = [
            _Block(rev[max(i - 1, 0)], w, layers + 1, groups, None if i == last else "up") for i, w in enumerate(rev)
        ]
        self.conv_norm_out = _GroupNorm(groups, widths[0])
        self.conv_out = nn.Conv2d(widths[0], cout, 3, padding=1)

    def __call__(self, z: mx.array) -> mx.array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(nn.silu(self.conv_norm_out(x)))


def _check(config: Mapping[str, Any]) -> None:
    """Refuse, naming the field, what this module would compute differently from Diffusers."""
    name = config.get("_class_name", "AutoencoderKL")
    if name != "AutoencoderKL":
        raise ValueError(f"_class_name {name!r}: only 'AutoencoderKL' is supported")
    for field in config:
        if not field.startswith("_") and field not in _READ | _INERT:
            raise ValueError(f"unsupported VAE config field {field!r}")
    widths = list(config.get("block_out_channels", [64]))
    for field, kind in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
        types = list(config.get(field, [kind]))
        if types != [kind] * len(widths):
            raise ValueError(f"unsupported {field} {types!r}: only {len(widths)} x {kind!r} (one per block_out_channels)")
    if (act := config.get("act_fn", "silu")) not in ("silu", "swish"):  # Diffusers' two names for SiLU
        raise ValueError(f"unsupported act_fn {act!r}: only 'silu'")
    groups = int(config.get("norm_num_groups", 32))
    if groups <= 0 or any(w % groups for w in widths):
        raise ValueError(f"norm_num_groups {groups} does not divide block_out_channels {widths}")
    if int(config.get("layers_per_block", 1)) < 1:
        raise ValueError("layers_per_block must be at least 1")
    for field in ("latents_mean", "latents_std"):
        # the decode contract is z / scaling_factor + shift_factor; per-channel statistics
        # would make it wrong without anyone noticing
        if config.get(field) is not None:
            raise ValueError(f"unsupported {field}: per-channel latent normalisation")


class AutoencoderKL(nn.Module):
    """Diffusers' ``AutoencoderKL`` from its ``config.json`` dict; parameters under the same names
    as Diffusers' (bar ``to_out.0`` -> ``to_out``), convolutions OHWI."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        _check(config)
        widths = [int(w) for w in config.get("block_out_channels", [64])]
        layers = int(config.get("layers_per_block", 1))
        groups = int(config.get("norm_num_groups", 32))
        attention = bool(config.get("mid_block_add_attention", True))
        latent = int(config.get("latent_channels", 4))
        self.latent_channels = latent
        self.scaling_factor = float(config.get("scaling_factor", 0.18215))
        shift = config.get("shift_factor")
        self.shift_factor = 0.0 if shift is None else float(shift)
        self.scale = 2 ** (len(widths) - 1)
        self.encoder = _Encoder(int(config.get("in_channels", 3)), latent, widths, layers, groups, attention)
        self.decoder = _Decoder(latent, int(config.get("out_channels", 3)), widths, layers, groups, attention)
        if config.get("use_quant_conv", True):
            self.quant_conv = nn.Conv2d(2 * latent, 2 * latent, 1)
        if config.get("use_post_quant_conv", True):
            self.post_quant_conv = nn.Conv2d(latent, latent, 1)

    def decode(self, z: mx.array) -> mx.array:
        """``z`` ``[B, h, w, latent_channels]``, already unscaled -> images ``[B, h*scale,
        w*scale, 3]`` float32 in the VAE's own range (about -1..1, not clipped)."""
        z = z.astype(self.decoder.conv_in.weight.dtype)  # run in the weights' dtype: bf16 halves the memory
        if "post_quant_conv" in self:
            z = self.post_quant_conv(z)
        return self.decoder(z).astype(mx.float32)

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x`` ``[B, H, W, 3]`` in -1..1 -> ``(mean, logvar)``, each ``[B, H/scale, W/scale,
        latent_channels]`` float32, the log-variance clamped to [-30, 20] as Diffusers does."""
        h = self.encoder(x.astype(self.encoder.conv_in.weight.dtype))
        if "quant_conv" in self:
            h = self.quant_conv(h)
        h = h.astype(mx.float32)
        mean, logvar = mx.split(h, 2, axis=-1)
        return mean, mx.clip(logvar, -30.0, 20.0)


# the attention's names in checkpoints written before Diffusers renamed them (it converts on load)
_LEGACY = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out", "to_out.0": "to_out"}


def diffusers_to_mlx(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """A Diffusers ``AutoencoderKL`` checkpoint's tensors under this module's names and layouts."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        module, _, leaf = name.rpartition(".")
        for old, new in _LEGACY.items():
            if module.endswith(f".attentions.0.{old}"):
                module = module.removesuffix(old) + new
                # some old checkpoints store the projections as 1x1 convolutions
                value = value.reshape(value.shape[:2]) if value.ndim == 4 else value
                break
        if value.ndim == 4:  # PyTorch's OIHW -> MLX's OHWI
            value = value.transpose(0, 2, 3, 1)
        out[f"{module}.{leaf}"] = value
    return out


def load_vae(directory: Path, dtype: mx.Dtype | None = None) -> AutoencoderKL:
    """The VAE of a Diffusers pipeline's ``vae/`` folder (``config.json`` and
    ``diffusion_pytorch_model.safetensors``), strictly: a missing, unexpected or misshapen tensor
    is a ValueError naming it.  ``dtype``: cast to it (else the file's dtype is kept)."""
    directory = Path(directory)
    model = AutoencoderKL(json.loads((directory / "config.json").read_text()))
    weights = diffusers_to_mlx(mx.load(str(directory / _WEIGHTS)))
    expected = dict(tree_flatten(model.parameters()))
    if missing := sorted(expected.keys() - weights.keys()):
        raise ValueError(f"{directory / _WEIGHTS}: missing tensor(s) {', '.join(missing)}")
    if unexpected := sorted(weights.keys() - expected.keys()):
        raise ValueError(f"{directory / _WEIGHTS}: unexpected tensor(s) {', '.join(unexpected)}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise ValueError(f"tensor {name}: shape {value.shape}, expected {expected[name].shape}")
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    model.update(tree_unflatten(list(weights.items())))
    model.eval()
    mx.eval(model.parameters())
    return model
