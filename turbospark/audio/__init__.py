"""Audio: speech-to-text, realtime transcription, text-to-speech and the audio jobs.

The sans-io parts (no Trio, no threads, no MLX) are ``wav`` (decode, resample, encode),
``wire`` (the routes' checks, messages and output formats), ``jobs`` (the async job store) and
``realtime`` (a WebSocket session's buffer, frames and automatic commits).  ``engines`` says
what an engine is and holds the scripted ones; ``whisper`` and ``speech`` are the real ones.
"""
