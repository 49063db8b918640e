"""The actors: Trio tasks that own their state and an inbox. The observer, the generation queue
(with ``_fifo``, its sans-io policy), the model actors, the embedding and audio actors, and the
resolver (with ``lifecycle``, its sans-io load, keep-alive and eviction policy, and ``registry``,
the sans-io lookup of a model by name and capability). ``_mailbox`` holds the two sides of a
one-shot request/reply. Actors may import ``model``, ``messages``, ``errors`` and ``config``;
never ``routes`` or ``web``."""
