"""The flow-matching schedule (sans-io): which noise levels a run visits and how a step moves.

This is Diffusers' ``FlowMatchEulerDiscreteScheduler`` as ``ZImagePipeline`` drives it, in
float32 as it computes: the sigmas ``linspace(1, 1/steps, steps)``, shifted by the config's
``shift`` (``sigma' = shift * sigma / (1 + (shift - 1) * sigma)``) or, with
``use_dynamic_shifting``, by ``mu`` from the image's token count (exponential or linear time
shift); a terminal 0 appended; timesteps ``sigma * num_train_timesteps``.  An Euler step is
``x + (sigma_next - sigma) * velocity``.  The options that change the schedule otherwise (Karras,
exponential or beta sigmas, a shift terminal, stochastic sampling, inverted sigmas) are refused
by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

__all__ = ["Schedule", "preview_steps", "schedule_for"]

_REFUSED = (
    "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "shift_terminal",
    "stochastic_sampling", "invert_sigmas",
)  # fmt: skip


@attrs.frozen
class Schedule:
    """``sigmas`` has one more entry than ``timesteps`` (the terminal 0)."""

    timesteps: np.ndarray  # float32, [steps]
    sigmas: np.ndarray  # float32, [steps + 1]

    def model_time(self, i: int) -> float:
        """The time the transformer is given at step ``i``: ``(1000 - t) / 1000``, in float32."""
        t = np.float32(self.timesteps[i])
        return float((np.float32(1000) - t) / np.float32(1000))

    def dt(self, i: int) -> float:
        return float(self.sigmas[i + 1] - self.sigmas[i])


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse, by name, a scheduler config this schedule does not follow."""
    name = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if name != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"scheduler {name!r} is not supported (only FlowMatchEulerDiscreteScheduler)")
    for key in _REFUSED:
        if config.get(key):
            raise ValueError(f"the scheduler's {key} is not supported")
    if config.get("time_shift_type", "exponential") not in ("exponential", "linear"):
        raise ValueError(f"the scheduler's time_shift_type {config.get('time_shift_type')!r} is not supported")


def _mu(config: Mapping[str, Any], image_seq_len: int) -> float:
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def _linspace(start: float, end: float, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n)`` in float32, bit for bit (the pipeline's sigmas): a
    float32 step, the first half counted up from ``start`` and the rest down from ``end``, each
    point one fused multiply-add."""
    if n == 1:
        return np.array([start], np.float32)
    first, last = np.float32(start), np.float32(end)
    step = np.float32((last - first) / np.float32(n - 1))
    i = np.arange(n)
    up = (np.float64(first) + np.float64(step) * i).astype(np.float32)
    down = (np.float64(last) - np.float64(step) * (n - 1 - i)).astype(np.float32)
    return np.where(i < n // 2, up, down)


def schedule_for(config: Mapping[str, Any], steps: int, image_seq_len: int) -> Schedule:
    """The schedule of ``steps`` denoising steps for an image of ``image_seq_len`` patches."""
    check_config(config)
    if steps < 1:
        raise ValueError("at least one step")
    train = config.get("num_train_timesteps", 1000)
    sigmas = _linspace(1.0, 1.0 / steps, steps)
    if config.get("use_dynamic_shifting", False):
        mu = _mu(config, image_seq_len)
        base = np.float32(1.0) / sigmas - np.float32(1.0)
        if config.get("time_shift_type", "exponential") == "linear":
            sigmas = (mu / (mu + base)).astype(np.float32)
        else:
            sigmas = (math.exp(mu) / (math.exp(mu) + base)).astype(np.float32)
    else:
        shift = float(config.get("shift", 1.0))
        sigmas = (shift * sigmas / (1 + (shift - 1) * sigmas)).astype(np.float32)
    timesteps = (sigmas * np.float32(train)).astype(np.float32)
    return Schedule(timesteps, np.concatenate([sigmas, np.zeros(1, np.float32)]))


def preview_steps(steps: int, partial_images: int) -> list[int]:
    """After which steps (0-based) a preview is sent: ``partial_images`` of them, spread evenly
    before the last step (whose image is the final one)."""
    if partial_images <= 0 or steps <= 1:
        return []
    count = min(partial_images, steps - 1)
    return sorted({max(0, round((k + 1) * steps / (count + 1)) - 1) for k in range(count)})
