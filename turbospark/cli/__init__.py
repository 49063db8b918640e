"""The command line: ``serve``'s arguments and start-up (``main``, ``args``), which backends the
settings name (``attach``), the OpenBLAS preload (``blas``), interrupts while models are prepared
(``interrupt``) and ``python -m turbospark models`` (``models``). The top of the import graph: it
may import every other package; nothing imports it."""
