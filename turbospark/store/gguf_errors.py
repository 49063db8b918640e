"""The error every importer raises for a source it cannot take (``gguf_import`` re-exports it)."""

from __future__ import annotations

__all__ = ["ModelImportError"]


class ModelImportError(Exception):
    """A source cannot be imported: missing, corrupt, truncated or of an unsupported kind."""
