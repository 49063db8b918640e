"""The model store: import, pull, catalogue, GGUF conversion and tokenizer building.

It writes one directory per model holding everything the runtime needs (weights, config, tokenizer,
sampling defaults, manifest); the runtime in :mod:`turbospark.model` reads only such a directory and
never imports this package.
"""
