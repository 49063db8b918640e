"""The actors: Trio tasks that own their state and an inbox. The observer, the generation queue
(with ``_fifo``, its sans-io policy), the model actors, the embedding and audio actors, and the
resolver (``resolver``, the actor; ``resolution``, its messages and grants; ``_residency``, its
sans-io load state machine, leases, keep-alive deadlines and eviction choice; ``lifecycle``, what
a loadable model is and how keep-alive and sizes are read; ``registry``, every rule for finding a
model by name and capability). ``_mailbox`` holds the two sides of a one-shot request/reply.
Actors may import ``model``, ``audio``, ``messages``, ``errors`` and ``config``; never ``routes``,
``web`` or ``store``."""
