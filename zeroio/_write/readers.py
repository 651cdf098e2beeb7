"""Which processes of a distributed conversion read the source and write shards: decided by the storage the source
is on, not by the number of processes.

* Local files (one disk, a shared filesystem): one reader per host. Processes on one machine share its disk: on an
  H200 host, 4 processes each reading a quarter of the shards took 20.24 s against 6.83 s for one process (issue
  34), because each paid its own start-up and their reads interleaved on one disk, while one process's reader
  threads already take what the disk gives. So the first process of each host (``LOCAL_RANK`` 0 under torchrun)
  writes shards and the others only take part in the agreement.
* A URL (object store, HTTP, the Hub): every process of the host. An object store limits each connection, and a
  process keeps about its ``workers`` ranged GETs in flight, so each reader adds its own connections (and its own
  event loop and CPU for HTTP) until the host's network link is full (docs/distributed.md, "Readers per host").

``ZEROIO_READERS_PER_HOST`` overrides both (several local disks; a store that throttles per client). Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .._env import env_positive_int
from .._io.remote_path import is_url
from .sharding import assign_shards

__all__ = ["READERS_ENV", "assign_to_readers", "reader_ranks", "readers_per_host"]

READERS_ENV = "ZEROIO_READERS_PER_HOST"
"""Environment variable: processes per host that read and write shards (default: 1 for local files, every process
of the host for a URL)."""


def _env_int(name: str) -> int | None:
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def readers_per_host(source: object, processes_per_host: int) -> int:
    """``ZEROIO_READERS_PER_HOST``, else what ``source``'s storage gives: every one of the host's
    ``processes_per_host`` for a URL (a :class:`~zeroio._io.remote_path.RemotePath` or its text), 1 for a local path."""
    override = os.environ.get(READERS_ENV, "").strip()
    if override:  # a value that is no count is refused by name (it was taken as unset)
        return env_positive_int(READERS_ENV, override)
    text = str(source)
    remote = is_url(text) and not text.startswith("file://")
    return processes_per_host if remote else 1


def reader_ranks(world_size: int, source: object) -> tuple[int, ...]:
    """The ranks that write shards when converting ``source``, in rank order.

    Under torchrun (``WORLD_SIZE`` = ``world_size`` and ``LOCAL_WORLD_SIZE`` dividing it, ranks numbered host by
    host): the first :func:`readers_per_host` ranks of each host. Otherwise (the hosts are unknown): every rank.
    """
    local = _env_int("LOCAL_WORLD_SIZE")
    if local is None or _env_int("WORLD_SIZE") != world_size or world_size % local:
        return tuple(range(world_size))
    per_host = min(readers_per_host(source, local), local)
    return tuple(host * local + k for host in range(world_size // local) for k in range(per_host))


def assign_to_readers(sizes: Sequence[int], world_size: int, source: object) -> tuple[int, ...]:
    """:func:`~zeroio._write.sharding.assign_shards` over the :func:`reader_ranks` only: each shard's writer."""
    readers = reader_ranks(world_size, source)
    return tuple(readers[i] for i in assign_shards(sizes, len(readers)))
