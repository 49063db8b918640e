"""HTTP routes: thin Quart-Trio handlers that talk to actors through messages."""

from ._app import create_app as create_app

__all__ = ["create_app"]
