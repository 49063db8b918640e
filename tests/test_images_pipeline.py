"""The MLX Z-Image pipeline against Diffusers' on the same tiny random pipeline (torch's CPU
build): the schedule bit for bit, the text encoder's conditioning, and whole runs, text-to-image
(with and without guidance, square and not, several images) and image-to-image, given the same
starting latents.  Tolerances: the conditioning within 1e-5 of its scale; the 8-bit images within
one level per channel (the rounding of float32 work done in another order).  Then what the
server relies on: previews, and ``check()`` stopping a run before its next step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import mlx.core as mx  # noqa: E402

from turbospark.errors import RequestInvalid  # noqa: E402
from turbospark.images.pipeline import GenerateArgs, ZImagePipeline, preview_steps  # noqa: E402
from turbospark.images.schedule import schedule_for  # noqa: E402

from .image_pipelines import tiny_zimage  # noqa: E402

PROMPT = "a red fox in the snow, watercolour"


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zimage") / "pipeline"


@pytest.fixture(scope="module")
def pipelines(directory: Path) -> tuple[Any, ZImagePipeline]:
    reference = tiny_zimage(directory)
    return reference, ZImagePipeline(directory, "tiny")


def _np(x: Any) -> np.ndarray:
    return x.detach().float().numpy() if hasattr(x, "detach") else np.asarray(x)


@pytest.mark.parametrize(
    "config",
    [
        {"shift": 3.0},
        {"shift": 1.0},
        {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15},
        {"use_dynamic_shifting": True, "time_shift_type": "linear"},
    ],
)
@pytest.mark.parametrize("steps", [1, 4, 9, 28])
def test_the_schedule_is_the_references(config: dict[str, Any], steps: int) -> None:
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    seq_len = 1024
    mu = calculate_shift(seq_len) if config.get("use_dynamic_shifting") else None
    sigmas = torch.linspace(1.0, 1 / steps, steps).tolist()
    scheduler.set_timesteps(steps, sigmas=sigmas, mu=mu)
    ours = schedule_for(dict(scheduler.config), steps, seq_len)
    assert np.array_equal(ours.sigmas, _np(scheduler.sigmas))
    assert np.array_equal(ours.timesteps, _np(scheduler.timesteps))


def test_a_schedule_option_it_does_not_follow_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        schedule_for({"use_karras_sigmas": True}, 4, 16)


def test_the_conditioning_is_the_references(pipelines: tuple[Any, ZImagePipeline]) -> None:
    reference, ours = pipelines
    expected, _ = reference.encode_prompt([PROMPT], do_classifier_free_guidance=False)
    got = np.array(ours.encoder.encode(PROMPT))
    want = _np(expected[0])
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize(
    ("width", "height", "n", "guidance"),
    [(64, 64, 1, 0.0), (64, 96, 2, 0.0), (96, 64, 1, 4.0)],
)
def test_a_run_gives_the_references_image(
    pipelines: tuple[Any, ZImagePipeline], width: int, height: int, n: int, guidance: float
) -> None:
    reference, ours = pipelines
    latents = np.random.default_rng(width + n).standard_normal((n, 16, height // 4, width // 4)).astype(np.float32)
    want = reference(
        PROMPT, height=height, width=width, num_inference_steps=3, guidance_scale=guidance,
        negative_prompt="blurry" if guidance else None, num_images_per_prompt=n,
        latents=torch.from_numpy(latents), output_type="np",
    ).images  # fmt: skip
    want8 = np.round(want * 255).astype(np.uint8)
    args = GenerateArgs(PROMPT, width, height, n=n, steps=3, guidance_scale=guidance, negative_prompt="blurry")
    got = ours.generate(args, lambda: None, latents=mx.array(latents))
    assert [g.shape for g in got] == [(height, width, 3)] * n
    assert max(np.abs(g.astype(int) - w.astype(int)).max() for g, w in zip(got, want8)) <= 1
    assert np.std(got[0]) > 1  # an image, not a flat colour


def test_an_edit_gives_the_references_image(pipelines: tuple[Any, ZImagePipeline]) -> None:
    reference, ours = pipelines
    img2img = diffusers.ZImageImg2ImgPipeline(**reference.components)
    img2img.set_progress_bar_config(disable=True)
    rgb = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    noise = mx.array(np.random.default_rng(6).standard_normal((1, 16, 16, 16)).astype(np.float32))
    args = GenerateArgs(PROMPT, 64, 64, steps=4, seed=9, image=rgb, strength=0.5)
    schedule = schedule_for(ours.scheduler_config, 4, 64)
    start, noised = ours._noised_image(args, schedule, noise)
    assert start == 2  # half the steps kept

    # the noised start is the reference's formula on the VAE's posterior (the same draw)
    with torch.no_grad():
        posterior = reference.vae.encode(torch.from_numpy(rgb.astype(np.float32) / 127.5 - 1).permute(2, 0, 1)[None])
    mean, logvar = ours.vae.encode(mx.array(rgb.astype(np.float32) / 127.5 - 1.0)[None])
    assert np.abs(np.array(mean.transpose(0, 3, 1, 2)) - _np(posterior.latent_dist.mean)).max() < 1e-4
    eps = mx.random.normal(mean.shape, key=mx.random.key(args.seed + 1))
    sample = (mean + mx.exp(0.5 * logvar) * eps - ours.vae.shift_factor) * ours.vae.scaling_factor
    sigma = float(schedule.sigmas[start])
    expected = sigma * noise + (1 - sigma) * sample.transpose(0, 3, 1, 2)
    assert np.abs(np.array(noised - expected)).max() < 1e-5

    want = img2img(
        PROMPT, image=[rgb], height=64, width=64, num_inference_steps=4, strength=0.5, guidance_scale=0.0,
        latents=torch.from_numpy(np.array(noised)), output_type="np",
    ).images  # fmt: skip
    got = ours.generate(args, lambda: None, latents=noise)
    assert np.abs(got[0].astype(int) - np.round(want[0] * 255).astype(int)).max() <= 1


def test_previews_come_spread_over_the_run() -> None:
    assert preview_steps(9, 0) == []
    assert preview_steps(9, 1) == [3]
    assert preview_steps(9, 3) == [1, 3, 6]
    assert preview_steps(2, 3) == [0]
    assert preview_steps(1, 2) == []


def test_check_stops_a_run_before_its_next_step(pipelines: tuple[Any, ZImagePipeline]) -> None:
    _, ours = pipelines
    seen: list[tuple[int, int]] = []
    previews: list[int] = []

    class Left(Exception):
        pass

    def check() -> None:
        if len(seen) == 3:
            raise Left()

    args = GenerateArgs(PROMPT, 64, 64, steps=20, partial_images=2)
    with pytest.raises(Left):
        ours.generate(args, check, lambda i, images: previews.append(i), progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 20), (2, 20), (3, 20)] and previews == []  # the first preview is due after step 7
    done = ours.generate(attrs_evolve(args, steps=6), lambda: None, lambda i, images: previews.append(i))
    assert previews == [0, 1] and len(done) == 1  # partial images 0 and 1 (after steps 2 and 4)


def attrs_evolve(args: GenerateArgs, **changes: Any) -> GenerateArgs:
    import attrs

    return attrs.evolve(args, **changes)


def test_a_size_off_the_models_multiple_is_refused(pipelines: tuple[Any, ZImagePipeline]) -> None:
    _, ours = pipelines
    with pytest.raises(RequestInvalid, match="multiples of 8"):
        ours.generate(GenerateArgs(PROMPT, 60, 64, steps=1), lambda: None)


def test_the_same_seed_gives_the_same_image(pipelines: tuple[Any, ZImagePipeline], tmp_path: Path) -> None:
    _, ours = pipelines
    one = ours.generate(GenerateArgs(PROMPT, 64, 64, steps=2, seed=11), lambda: None)
    two = ours.generate(GenerateArgs(PROMPT, 64, 64, steps=2, seed=11), lambda: None)
    other = ours.generate(GenerateArgs(PROMPT, 64, 64, steps=2, seed=12), lambda: None)
    assert np.array_equal(one[0], two[0]) and not np.array_equal(one[0], other[0])


def test_narrow_weights_compute_in_float32_on_the_cpu(pipelines: tuple[Any, ZImagePipeline], directory: Path) -> None:
    """A pipeline held in bfloat16 (as a large one is on the CPU) keeps its weights narrow and runs
    every product in float32: its image is the one a float32 pipeline makes from the same
    bfloat16-rounded weights."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    from turbospark.images.widen import WideLinear

    narrow = ZImagePipeline(directory, "tiny-bf16", mx.bfloat16)
    rounded = ZImagePipeline(directory, "tiny-rounded", mx.float32)
    for model in (rounded.transformer, rounded.encoder.model):
        model.update(tree_map(lambda a: a.astype(mx.bfloat16).astype(mx.float32), model.parameters()))
    for model in (narrow.transformer, narrow.encoder.model):
        linears = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, WideLinear))]
        assert linears and all(isinstance(m, WideLinear) for m in linears)
        assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert narrow.vae.decoder.conv_in.weight.dtype == mx.float32
    args = GenerateArgs(PROMPT, 64, 48, steps=3, seed=4)
    got, want = narrow.generate(args, lambda: None), rounded.generate(args, lambda: None)
    assert np.abs(got[0].astype(int) - want[0].astype(int)).max() <= 1
    assert np.std(got[0]) > 1
