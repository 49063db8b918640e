"""Rank 0's lifeline to the other ranks of a sharded model (``serve --distributed``).

Every forward pass needs every rank, and MLX's ring all-sum has no timeout: a rank that dies
makes rank 0's next collective fail, one that cannot be reached (stopped, cut off) makes it wait
for ever.  So each follower keeps a TCP connection to rank 0 and writes a byte on it every
``BEAT`` seconds from a thread of its own (MLX lets go of the GIL while a collective waits).
Rank 0 watches every connection from Trio; the loss of a rank is any of

- a connection that ends (the rank exited or was killed),
- ``LOST_AFTER`` seconds without a byte (stopped, or cut off),
- a collective that fails on the model thread (``ShardedBackend``'s ``on_lost``).

Then this server can serve nothing more: every request in flight and every new one is answered
a retryable 503 ``rank_lost`` (``System.fail``; a stream ends with its error event), and the
process exits with status 1 once those answers had ``FLUSH`` seconds to be written, without
waiting for a model thread that may never come back from its collective.  Once rank 0 tells the
followers to end (the model's close, at shutdown), their connections closing is no loss.

Rank 0 listens on its own address from mlx's hostfile (``MLX_HOSTFILE``: the ring's addresses
per rank), on a port the ranks agree on at their start-up barrier.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import trio

from ..errors import RankLost
from .attach import ModelSetupError

__all__ = ["BEAT", "FLUSH", "LOST_AFTER", "Lifeline", "beat", "rank_zero_host"]

log = logging.getLogger("turbospark")

BEAT = 1.0  # seconds between a follower's heartbeats
LOST_AFTER = 5.0  # seconds of silence after which a rank is lost
FLUSH = 3.0  # seconds the 503s get to be written (and new requests answered 503) before the process exits
ACCEPT_TIMEOUT = 120.0  # seconds rank 0 waits for every follower to connect


def rank_zero_host() -> str:
    """Rank 0's address in mlx's hostfile (a JSON list, per rank, of ``ip:port``); loopback
    when there is none."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        with open(path or "") as f:
            first = json.load(f)[0][0]
        return str(first).rpartition(":")[0] or "127.0.0.1"
    except (OSError, ValueError, IndexError, TypeError, KeyError):
        return "127.0.0.1"


class Lifeline:
    """Rank 0's end: a listening socket, then one connection per follower."""

    def __init__(self, followers: int) -> None:
        self.followers = followers
        self.listener = socket.create_server((rank_zero_host(), 0))
        self.port: int = self.listener.getsockname()[1]
        self.peers: list[socket.socket] = []
        self._why: str | None = None
        self._lost = trio.Event()
        self._ending = False

    def accept(self, timeout: float = ACCEPT_TIMEOUT) -> None:
        """Wait (blocking, before Trio runs) until every follower has connected."""
        self.listener.settimeout(timeout)
        with self.listener:
            while len(self.peers) < self.followers:
                try:
                    peer, _ = self.listener.accept()
                except TimeoutError:
                    raise ModelSetupError(f"only {len(self.peers)} of {self.followers} other ranks connected "
                                          f"to rank 0 within {timeout:g} s") from None
                self.peers.append(peer)

    def report(self, why: str) -> None:
        """A rank is lost (on the Trio thread; the first report wins)."""
        if self._why is None:
            self._why = why
            self._lost.set()

    def report_from_thread(self, why: str) -> None:
        """A collective failed on the model thread: report it, then wait there for the exit."""
        trio.from_thread.run_sync(self.report, why)
        threading.Event().wait()

    def ending(self) -> None:
        """Rank 0 tells the followers to end (``ShardedBackend.close``, on the model thread):
        their connections close from now on, and that is no loss."""
        self._ending = True

    async def watch(self, server: Any) -> None:
        """On the loss of a rank, answer everything 503 and exit 1 (a shutdown under way
        included: its model thread would wait for the lost rank too)."""
        async with trio.open_nursery() as nursery:
            for rank, peer in enumerate(self.peers, start=1):
                nursery.start_soon(self._listen, rank, peer)
            await self._lost.wait()
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):  # a shutdown that began meanwhile cannot stop this
            log.error("a rank of the sharded model is lost (%s): answering 503 and exiting", self._why)
            print(f"turbospark: a rank of the sharded model is lost ({self._why}), exiting",
                  file=sys.stderr, flush=True)
            server.system.fail(RankLost(str(self._why)))
            await trio.sleep(FLUSH)
            os._exit(1)  # the model thread may be inside a collective that never returns

    async def _listen(self, rank: int, peer: socket.socket) -> None:
        sock = trio.socket.from_stdlib_socket(peer)
        while True:
            with trio.move_on_after(LOST_AFTER) as quiet:
                try:
                    data = await sock.recv(64)
                except OSError as exc:
                    self.report(f"rank {rank}'s connection failed: {exc}")
                    return
            if self._ending:
                return
            if quiet.cancelled_caught:
                self.report(f"rank {rank} sent no heartbeat for {LOST_AFTER:g} s")
                return
            if not data:
                self.report(f"rank {rank} exited")
                return


def beat(host: str, port: int) -> None:
    """A follower's end: connect to rank 0 and write a byte every ``BEAT`` seconds from a daemon
    thread, until the connection fails (rank 0 is gone: the collectives end this rank)."""
    sock = socket.create_connection((host, port), timeout=ACCEPT_TIMEOUT)
    sock.settimeout(None)

    def run() -> None:
        with sock:
            while True:
                try:
                    sock.sendall(b".")
                except OSError:
                    return
                time.sleep(BEAT)

    threading.Thread(target=run, name="turbospark-heartbeat", daemon=True).start()
