"""The MLX Z-Image transformer against Diffusers' ``ZImageTransformer2DModel``, on a tiny random
model: every parameter randomised (norms, pad tokens and the zero-initialised final layer too),
saved with ``save_pretrained`` and loaded by ``load_transformer``.

Tolerance: float32 runs must agree to 1e-4 of the reference output's largest magnitude
(max |ours - ref| <= 1e-4 * max |ref|); an item batched and the same item alone to 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from turbospark.images.zimage_dit import ZImageDiT, load_transformer  # noqa: E402

CONFIG: dict[str, Any] = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 32,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [8, 12, 12],  # sums to the head dim, 32
    "axes_lens": [128, 32, 32],
}
RTOL = 1e-4  # of max |reference|
ALONE_RTOL = 1e-5


def _random_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = diffusers.ZImageTransformer2DModel(**CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights: near one, never one
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "pad_token" in name:
                p.copy_(torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            else:  # biases
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = _random_model()
    directory = tmp_path_factory.mktemp("zimage") / "transformer"
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def ours(reference: tuple[Any, Path]) -> ZImageDiT:
    return load_transformer(reference[1])


def _inputs(
    seed: int, hw: tuple[int, int], caption_lens: list[int]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    b = len(caption_lens)
    latents = rng.standard_normal((b, CONFIG["in_channels"], *hw)).astype(np.float32)
    t = rng.uniform(0.05, 0.95, b).astype(np.float32)
    caps = [rng.standard_normal((n, CONFIG["cap_feat_dim"])).astype(np.float32) for n in caption_lens]
    return latents, t, caps


def _torch_out(model: Any, latents: np.ndarray, t: np.ndarray, caps: list[np.ndarray]) -> np.ndarray:
    dtype = next(model.parameters()).dtype
    x = [torch.from_numpy(item)[:, None].to(dtype) for item in latents]  # [C, F=1, H, W]
    c = [torch.from_numpy(cap).to(dtype) for cap in caps]
    with torch.no_grad():
        out = model(x, torch.from_numpy(t), c, return_dict=False)[0]
    return np.stack([o[:, 0].float().numpy() for o in out])


def _mlx_out(model: ZImageDiT, latents: np.ndarray, t: np.ndarray, caps: list[np.ndarray]) -> np.ndarray:
    out = model(mx.array(latents), mx.array(t), [mx.array(cap) for cap in caps])
    assert out.dtype == mx.float32
    return np.array(out)


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize(
    ("hw", "caption"),
    [((8, 8), 7), ((16, 16), 32)],  # padded image and caption; neither padded (64 patches, 32 tokens)
)
def test_one_item_matches_diffusers(
    reference: tuple[Any, Path], ours: ZImageDiT, hw: tuple[int, int], caption: int
) -> None:
    latents, t, caps = _inputs(1, hw, [caption])
    ref = _torch_out(reference[0], latents, t, caps)
    assert _rel(_mlx_out(ours, latents, t, caps), ref) <= RTOL


def test_batch_with_different_captions_matches_diffusers(
    reference: tuple[Any, Path], ours: ZImageDiT
) -> None:
    # non-square latents (2 x 3 patches, padded to 32); captions padded to 32 and 64 tokens
    latents, t, caps = _inputs(2, (4, 6), [5, 40])
    ref = _torch_out(reference[0], latents, t, caps)
    batched = _mlx_out(ours, latents, t, caps)
    assert _rel(batched, ref) <= RTOL
    for i in range(2):  # each item as it comes alone
        alone = _mlx_out(ours, latents[i : i + 1], t[i : i + 1], caps[i : i + 1])
        assert _rel(batched[i : i + 1], alone) <= ALONE_RTOL
        ref_alone = _torch_out(reference[0], latents[i : i + 1], t[i : i + 1], caps[i : i + 1])
        assert _rel(alone, ref_alone) <= RTOL


def test_bf16_weights_load(tmp_path: Path) -> None:
    model = _random_model(seed=3).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="200KB")  # sharded, with an index
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").exists()
    latents, t, caps = _inputs(4, (4, 6), [5, 40])
    ref = _torch_out(model.float(), latents, t, caps)  # the same bf16-rounded weights, in float32

    upcast = load_transformer(tmp_path, dtype=mx.float32)
    assert upcast.x_embedder.weight.dtype == mx.float32
    assert _rel(_mlx_out(upcast, latents, t, caps), ref) <= RTOL

    kept = load_transformer(tmp_path)  # as stored: bfloat16 weights, bfloat16 compute
    assert kept.layers[0].to_q.weight.dtype == mx.bfloat16
    assert _rel(_mlx_out(kept, latents, t, caps), ref) <= 0.1  # bf16 rounding through every layer


def test_missing_or_unexpected_tensor_is_named(reference: tuple[Any, Path], tmp_path: Path) -> None:
    stored = mx.load(str(reference[1] / "diffusion_pytorch_model.safetensors"))
    config = (reference[1] / "config.json").read_text()

    def write(weights: dict[str, mx.array]) -> Path:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        (directory / "config.json").write_text(config)
        mx.save_safetensors(str(directory / "diffusion_pytorch_model.safetensors"), weights)
        return directory

    name = "layers.1.attention.to_k.weight"
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_transformer(write({k: v for k, v in stored.items() if k != name}))
    with pytest.raises(ValueError, match="unexpected tensor 'layers.2.feed_forward.w1.weight'"):
        extra = stored["layers.1.feed_forward.w1.weight"]
        load_transformer(write({**stored, "layers.2.feed_forward.w1.weight": extra}))
    with pytest.raises(ValueError, match="unexpected tensor 'siglip_pad_token'"):
        load_transformer(write({**stored, "siglip_pad_token": stored["x_pad_token"]}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("all_patch_size", [4]),
        ("all_f_patch_size", [2]),
        ("siglip_feat_dim", 16),
        ("n_kv_heads", 1),
        ("axes_dims", [8, 8, 8]),
        ("rope_scaling", 2.0),
    ],
)
def test_unsupported_config_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        ZImageDiT({**CONFIG, field: value})
