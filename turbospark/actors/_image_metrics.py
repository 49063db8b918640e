"""The image jobs' series in ``/metrics`` (the observer's, kept apart to keep it short).

- ``turbospark_image_jobs{kind,outcome}``: jobs ended (done, failed, cancelled, shutdown);
- ``turbospark_image_cancellations{phase}``: jobs stopped because their client left (queued,
  running): a client that hangs up mid-run is counted here at the step it stopped;
- ``turbospark_image_steps``, ``turbospark_images_generated``: denoising steps run, images made;
- ``turbospark_image_job_seconds{kind}``: how long jobs ran;
- ``turbospark_images_in_flight``, ``turbospark_image_busy`` (refused: the model's queue was
  full), ``turbospark_image_models_loaded``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Summary

from ..images.messages import ImageBusyEvent, ImageJobBegan, ImageJobEnded, ImageModelsChanged

__all__ = ["IMAGE_EVENTS", "ImageMetrics"]

IMAGE_EVENTS = (ImageBusyEvent, ImageJobBegan, ImageJobEnded, ImageModelsChanged)


class ImageMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.jobs = Counter(
            "turbospark_image_jobs", "Image jobs ended, by kind and outcome (done, failed, cancelled, shutdown)",
            ["kind", "outcome"], registry=reg,
        )  # fmt: skip
        self.cancellations = Counter(
            "turbospark_image_cancellations", "Image jobs stopped because their client left, by phase",
            ["phase"], registry=reg,
        )  # fmt: skip
        for phase in ("queued", "running"):
            self.cancellations.labels(phase)
        self.steps = Counter("turbospark_image_steps", "Denoising steps run", registry=reg)
        self.images = Counter("turbospark_images_generated", "Images generated", registry=reg)
        self.seconds = Summary("turbospark_image_job_seconds", "Time image jobs ran", ["kind"], registry=reg)
        self.in_flight = Gauge("turbospark_images_in_flight", "Image jobs a model's thread is running", registry=reg)
        self.busy = Counter("turbospark_image_busy", "Image requests refused: the model's queue was full", registry=reg)
        self.models = Gauge("turbospark_image_models_loaded", "Image models loaded", registry=reg)

    def record(self, event: object) -> None:
        if isinstance(event, ImageJobBegan):
            self.in_flight.inc()
        elif isinstance(event, ImageJobEnded):
            if event.phase == "running":
                self.in_flight.dec()
            self.jobs.labels(event.kind, event.outcome).inc()
            if event.outcome == "cancelled":
                self.cancellations.labels(event.phase).inc()
            self.steps.inc(event.steps)
            self.images.inc(event.images)
            self.seconds.labels(event.kind).observe(event.seconds)
        elif isinstance(event, ImageBusyEvent):
            self.busy.inc()
        elif isinstance(event, ImageModelsChanged):
            self.models.set(event.loaded)
