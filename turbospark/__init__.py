"""turbospark: a local generation server on Trio and MLX."""

__version__ = "0.1.0"

__all__ = ["__version__"]
