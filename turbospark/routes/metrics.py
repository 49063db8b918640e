"""``GET /metrics`` (and ``/v1/metrics``): Prometheus text, rendered by the observer actor."""

from __future__ import annotations

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from quart import Blueprint, Response

from ..web.app import system

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
@blueprint.get("/v1/metrics")
async def metrics() -> Response:
    return Response(await system().metrics(), content_type=CONTENT_TYPE_LATEST)
