"""Backends: the sync side that runs on each model's own thread (no Trio imports except
``_worker``)."""
