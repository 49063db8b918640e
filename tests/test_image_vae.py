"""The MLX ``AutoencoderKL`` against Diffusers' own, on tiny random VAEs saved with ``save_pretrained``.

Every parameter is randomised (GroupNorm affines too, so a norm mixed up with another would
show), and the comparisons are float32 on CPU: the largest absolute difference, relative to the
reference's largest magnitude, must stay under ``TOLERANCE``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import mlx.core as mx  # noqa: E402

from turbospark.images.vae import AutoencoderKL, load_vae  # noqa: E402

# float32 throughout: only the order of summation differs (measured ~1e-6)
TOLERANCE = 1e-4


def _tiny(latent: int, quant: bool, *, groups: int = 8, attention: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64],
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        layers_per_block=1,
        norm_num_groups=groups,
        latent_channels=latent,
        use_quant_conv=quant,
        use_post_quant_conv=quant,
        mid_block_add_attention=attention,
        scaling_factor=0.3611,
        shift_factor=0.1159 if latent == 16 else None,
    )
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.ndim == 1:  # norm scales: around 1, not 1
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # fan-in scaled, so activations stay O(1) through the stack
                p.copy_(torch.randn_like(p) / np.sqrt(p[0].numel()))
    return vae.eval()


def _rel(ours: mx.array, ref: torch.Tensor) -> float:
    ref_np = ref.permute(0, 2, 3, 1).numpy()  # NCHW -> NHWC
    ours_np = np.array(ours)
    assert ours_np.shape == ref_np.shape
    return float(np.abs(ours_np - ref_np).max() / np.abs(ref_np).max())


def _compare(vae: torch.nn.Module, directory: Path, dtype: mx.Dtype | None = None) -> tuple[float, float, float]:
    ours = load_vae(directory, dtype)
    latent = vae.config.latent_channels
    z = torch.randn(2, latent, 4, 6, generator=torch.Generator().manual_seed(1))
    x = torch.rand(2, 3, 16, 24, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        image = vae.decode(z).sample
        posterior = vae.encode(x).latent_dist
    decoded = ours.decode(mx.array(z.permute(0, 2, 3, 1).numpy()))
    mean, logvar = ours.encode(mx.array(x.permute(0, 2, 3, 1).numpy()))
    assert decoded.dtype == mx.float32 and decoded.shape == (2, 4 * ours.scale, 6 * ours.scale, 3)
    return _rel(decoded, image), _rel(mean, posterior.mean), _rel(logvar, posterior.logvar)


@pytest.mark.parametrize(("latent", "quant"), [(16, False), (4, True)])
def test_matches_diffusers(tmp_path: Path, latent: int, quant: bool) -> None:
    vae = _tiny(latent, quant)
    vae.save_pretrained(tmp_path)
    decode, mean, logvar = _compare(vae, tmp_path)
    assert max(decode, mean, logvar) < TOLERANCE, (decode, mean, logvar)
    ours = load_vae(tmp_path)
    assert ours.latent_channels == latent and ours.scale == 2 and ours.scaling_factor == pytest.approx(0.3611)
    assert ours.shift_factor == (pytest.approx(0.1159) if latent == 16 else 0.0)
    assert ("quant_conv" in ours) == quant and ("post_quant_conv" in ours) == quant


def test_without_mid_attention_and_32_groups(tmp_path: Path) -> None:
    vae = _tiny(16, False, groups=32, attention=False, seed=3)
    vae.save_pretrained(tmp_path)
    assert max(_compare(vae, tmp_path)) < TOLERANCE


def test_bf16_weights_load_as_float32(tmp_path: Path) -> None:
    vae = _tiny(16, False, seed=4)
    vae.to(torch.bfloat16).save_pretrained(tmp_path)
    header = _header(tmp_path / "diffusion_pytorch_model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    vae = vae.to(torch.float32)  # bf16 -> f32 is exact: the same numbers as were saved
    ours = load_vae(tmp_path, mx.float32)
    assert ours.decoder.conv_in.weight.dtype == mx.float32
    assert max(_compare(vae, tmp_path, mx.float32)) < TOLERANCE
    assert load_vae(tmp_path).decoder.conv_in.weight.dtype == mx.bfloat16  # no dtype: the file's


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def test_missing_or_unexpected_tensor_is_named(tmp_path: Path) -> None:
    _tiny(4, True).save_pretrained(tmp_path)
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    weights = mx.load(str(path))
    gone = "decoder.up_blocks.1.resnets.0.conv_shortcut.weight"
    mx.save_safetensors(str(path), {k: v for k, v in weights.items() if k != gone})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load_vae(tmp_path)
    mx.save_safetensors(str(path), {**weights, "decoder.extra.weight": mx.zeros((2,))})
    with pytest.raises(ValueError, match=r"decoder\.extra\.weight"):
        load_vae(tmp_path)
    bad = dict(weights, **{"quant_conv.bias": mx.zeros((3,))})
    mx.save_safetensors(str(path), bad)
    with pytest.raises(ValueError, match=r"quant_conv\.bias"):
        load_vae(tmp_path)


def _config() -> dict:
    return dict(_tiny(16, False).config)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("down_block_types", ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"]),
        ("up_block_types", ["UpDecoderBlock2D"]),
        ("act_fn", "gelu"),
        ("norm_num_groups", 24),
        ("latents_mean", [0.0] * 16),
        ("norm_type", "spatial"),
        ("_class_name", "AutoencoderKLWan"),
    ],
)
def test_unsupported_config_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        AutoencoderKL({**_config(), field: value})


def test_flux_config_shapes() -> None:
    config = {
        "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 2,
        "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
        "latents_mean": None, "latents_std": None, "force_upcast": True, "mid_block_add_attention": True,
        "use_quant_conv": False, "use_post_quant_conv": False,
    }  # fmt: skip
    vae = AutoencoderKL(config)
    assert vae.scale == 8 and "quant_conv" not in vae
    assert len(vae.decoder.up_blocks[0].resnets) == 3 and len(vae.encoder.down_blocks[0].resnets) == 2
