"""The processes of a job on one host, exchanging JSON over a Unix socket: :class:`~zeroio._ranks.Ranks` without
torch.

A distributed conversion on one host has one reader, process 0, which converts alone as a plain ``convert`` does;
the others only learn how it ended (:mod:`zeroio._write.one_reader`). Learning that through torch.distributed cost
every process torch's import and gloo's rendezvous, 2-4 s of CPU each: on the H100 host process 0's ``convert`` took
3.53 s against 2.48 s for a plain one (its import on a thread held the interpreter's lock, and the group was ready
only after it), and on 2 cores the imports alone outlasted the conversion. So on Linux these processes exchange their
few lines over an abstract Unix socket instead (no file, gone with its process): process 0 listens from its first
instant under a name derived from the job (torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, run id and restart count),
the destination and the call's number; each other process connects at its start. An exchange is one round through
process 0: every process sends its payload, process 0 answers each with all of them, in rank order.

Only processes of this user are accepted, on both sides (``SO_PEERCRED``). A process that dies closes its socket, so
the others learn it at once (:class:`~zeroio._ranks.RanksLost`); every wait is bounded by the job's timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from ._ranks import RanksLost

__all__ = ["SOCKETS_ENV", "HostRanks", "host_sockets"]

SOCKETS_ENV = "ZEROIO_HOST_SOCKETS"
"""Environment variable: 0 makes the processes of a one-host job meet in a gloo group instead of a Unix socket."""

_JOB_ENV = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE")
_RETRY = 0.02  # seconds between a process's attempts to reach process 0 before it listens
_HELLO_WAIT = 10.0  # seconds process 0 waits for the first line of a connection it accepted
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def host_sockets() -> bool:
    """Whether the processes of one host meet over a Unix socket: on Linux (abstract sockets), unless
    ``ZEROIO_HOST_SOCKETS=0`` asks for a gloo group (processes that share a host but not a network namespace).

    Raises:
        ValueError: ``ZEROIO_HOST_SOCKETS`` is neither 0 nor 1.
    """
    value = os.environ.get(SOCKETS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SOCKETS_ENV} must be 0 (a gloo group) or 1 (a Unix socket, on Linux), got {value!r}.")
    return value != "0" and sys.platform.startswith("linux")


def _peer_uid(conn: socket.socket) -> int:
    return int(_UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1])


class _Lines:
    """JSON lines on a connected socket, each read bounded by the socket's timeout."""

    def __init__(self, conn: socket.socket, peer: str) -> None:
        self.conn = conn
        self.peer = peer
        self._file = conn.makefile("rb")

    def send(self, message: Any) -> None:
        try:
            self.conn.sendall(json.dumps(message).encode("utf-8") + b"\n")
        except OSError as exc:  # BrokenPipeError, ConnectionResetError: the peer is gone
            raise RanksLost(f"{self.peer} closed its connection") from exc

    def receive(self) -> Any:
        try:
            line = self._file.readline()
        except TimeoutError as exc:
            raise RanksLost(f"{self.peer} did not answer within the timeout") from exc
        except OSError as exc:  # ConnectionResetError: it died before process 0 accepted the connection
            raise RanksLost(f"{self.peer} closed its connection") from exc
        if not line.endswith(b"\n"):
            raise RanksLost(f"{self.peer} closed its connection")
        try:
            return json.loads(line)
        except ValueError as exc:
            raise RanksLost(f"{self.peer} sent a line that is not JSON") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self.conn.close()


class HostRanks:
    """Process ``rank`` of ``world_size`` on this host, in the exchange named after the job, ``dst`` and ``call``
    (the same on every process): process 0 listens at once; any other connects at once, waiting up to ``timeout``
    seconds for process 0 to listen. :meth:`close` ends it.

    Raises:
        RanksLost: process 0 did not listen within ``timeout``, or its socket is held by another user's process.
        OSError: process 0 cannot listen (the name is taken).
    """

    def __init__(self, rank: int, world_size: int, dst: Path, call: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self._timeout = timeout
        text = "\0".join([*(os.environ.get(k, "") for k in _JOB_ENV), str(dst), str(call)])
        self._key = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self._name = b"\0zeroio-" + self._key[:40].encode("ascii")
        self._listener: socket.socket | None = None
        self._peers: list[_Lines] = []  # process 0: every other process, in rank order, once all connected
        if rank == 0:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._listener.bind(self._name)
                self._listener.listen(max(world_size, 8))
            except OSError:
                self._listener.close()
                raise
        else:
            self._peers = [self._connect()]

    def _connect(self) -> _Lines:
        deadline = time.monotonic() + self._timeout
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self._name)
                break
            except (ConnectionRefusedError, FileNotFoundError):  # process 0 does not listen yet
                conn.close()
                if time.monotonic() > deadline:
                    raise RanksLost(f"process 0 did not appear within {self._timeout:g} s") from None
                time.sleep(_RETRY)
        if _peer_uid(conn) != os.getuid():
            conn.close()
            raise RanksLost(f"the socket of process 0 is held by another user's process (uid {_peer_uid(conn)})")
        conn.settimeout(self._timeout)
        lines = _Lines(conn, "process 0")
        lines.send({"key": self._key, "rank": self.rank})
        return lines

    def _accept_all(self) -> None:
        """Process 0: every other process's connection, in rank order (others' sockets and strays are refused)."""
        assert self._listener is not None
        deadline = time.monotonic() + self._timeout
        found: dict[int, _Lines] = {}
        while len(found) < self.world_size - 1:
            self._listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, _ = self._listener.accept()
            except TimeoutError as exc:
                missing = sorted(set(range(1, self.world_size)) - set(found))
                raise RanksLost(f"process(es) {missing} did not connect within {self._timeout:g} s") from exc
            conn.settimeout(min(self._timeout, _HELLO_WAIT))  # a process sends its hello as it connects
            lines = _Lines(conn, "a process")
            try:
                hello = lines.receive() if _peer_uid(conn) == os.getuid() else None
            except RanksLost:
                hello = None
            rank = hello.get("rank") if isinstance(hello, dict) and hello.get("key") == self._key else None
            if not isinstance(rank, int) or not 0 < rank < self.world_size or rank in found:
                lines.close()  # not one of this exchange's processes
                continue
            conn.settimeout(self._timeout)
            lines.peer = f"process {rank}"
            found[rank] = lines
        self._peers = [found[r] for r in range(1, self.world_size)]

    def all_gather(self, payload: Any) -> list[Any]:
        """Every process's ``payload``, in rank order. Raises :class:`RanksLost` when a process is gone."""
        if self.rank != 0:
            (server,) = self._peers
            server.send({"payload": payload})
            reply = server.receive()
            return list(reply["all"])
        if len(self._peers) < self.world_size - 1:
            self._accept_all()
        gathered = [payload] + [peer.receive()["payload"] for peer in self._peers]
        for peer in self._peers:
            peer.send({"all": gathered})
        return gathered

    def close(self) -> None:
        for peer in self._peers:
            peer.close()
        self._peers = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
