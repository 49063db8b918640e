"""HTTP plumbing shared by every route family: the Quart-Trio app with its request scope, checks
and error shapes (``app``), which origins and hosts are answered (``origins``), SSE framing
(``sse``) and the OpenAPI document (``openapi``). It may import the system, ``wire``, ``config``,
``errors`` and ``messages``; never a route module (the routes import it, and ``routes/app.py``
hands it their blueprints)."""
