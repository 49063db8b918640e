"""HTTP routes, one module per API family: thin Quart-Trio handlers that translate a wire request
into messages for the actors and typed results back into wire events. They may import ``web/``
(the HTTP plumbing), ``wire/``, ``turns/``, the system and the message catalogue; never MLX or an
actor's state. ``app.py`` gathers them into the app."""
