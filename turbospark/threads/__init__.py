"""The pinned OS threads, one per loaded model: the model thread's continuous batch
(``model_thread``: its loop and its crossings into Trio; ``_batch``: admission, steps and endings;
``_jobs``: the per-job records; ``prompt``: rendering, encoding and the checks a job must pass;
``_admission``: sans-io batch slots and KV budget) and the encoder thread's cross-request batches
(``encoder_thread``; ``_embed_pool``: sans-io, which inputs the next forward pass runs), and
``pinned``, how an actor starts either and waits until it has loaded. The
only code that crosses from a thread into Trio (``trio.from_thread``), once per step. It may
import ``model`` (the sync backends), ``messages`` and ``errors``; the actors import it."""
