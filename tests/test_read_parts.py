"""Reads of a load to CUDA cut into parts (``ZEROIO_READ_BLOCK``): page-aligned cuts, and each part's bytes land
where the whole chunk's would, with ``O_DIRECT`` or from the page cache."""

from __future__ import annotations

import mmap
import os

import pytest

from zeroio._io.direct_read import ALIGN, aligned_parts, aligned_read, cached_read


@pytest.mark.parametrize(
    ("offset", "nbytes", "block"),
    [(0, 10, ALIGN), (5, 100_000, 2 * ALIGN), (ALIGN - 1, ALIGN + 2, ALIGN), (12_345, 1 << 20, 1 << 16), (8, 0, ALIGN)],
)
def test_parts_cover_the_range_and_cut_on_pages(offset, nbytes, block):
    parts = aligned_parts(offset, nbytes, block)
    assert sum(n for _, n in parts) == nbytes
    at = offset
    for i, (start, n) in enumerate(parts):
        assert start == at and n > 0
        if i:
            assert start % ALIGN == 0  # each part's aligned blocks are its own
        assert start - start % ALIGN + block >= start + n  # at most one block of aligned bytes
        at += n


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_parts_read_congruently_give_the_file_bytes(tmp_path):
    """Every part of a range at an odd offset, read with ``O_DIRECT`` into a page-aligned window at the offset's
    place in its page, gives the file's bytes there and nothing outside the range's aligned blocks; warm, the page
    cache gives the same bytes (``RWF_NOWAIT``) without the disk."""
    data = os.urandom(300_001)
    path = tmp_path / "blob"
    path.write_bytes(data)
    try:
        direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:  # tmpfs and the like refuse O_DIRECT: a load reads them buffered
        pytest.skip("the temporary folder's file system refuses O_DIRECT")
    buffered = os.open(path, os.O_RDONLY)
    buffer = mmap.mmap(-1, 200_000 + 3 * ALIGN)  # page-aligned, as a pinned buffer
    window = memoryview(buffer)
    try:
        for offset, nbytes, block in [(3, 200_000, ALIGN), (ALIGN * 5 + 17, 150_001, 3 * ALIGN), (299_990, 11, ALIGN)]:
            _evict(path)
            window[:] = b"\0" * len(window)
            at = offset % ALIGN
            for start, n in aligned_parts(offset, nbytes, block):
                assert aligned_read(direct, start, n, window, at + start - offset)
            assert window[at : at + nbytes] == data[offset : offset + nbytes]
            past = -(-(at + nbytes) // ALIGN) * ALIGN  # the end of the last aligned block
            assert not any(window[past:]), "written past the range's aligned blocks"
            os.pread(buffered, nbytes, offset)  # warm now
            window[:] = b"\0" * len(window)
            assert cached_read(buffered, offset, window[:nbytes]) in (nbytes, -1)
            assert window[:nbytes] == data[offset : offset + nbytes] or not hasattr(os, "RWF_NOWAIT")
        # no room for the two aligned blocks around them: False, so the caller reads them buffered
        assert not aligned_read(direct, 100, ALIGN, window[:ALIGN], 100)
    finally:
        window.release()
        buffer.close()
        os.close(direct)
        os.close(buffered)
