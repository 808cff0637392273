"""Streaming uploads: an object uploaded while its bytes are produced (the checkpoint writer's
files), many parts in parallel, committed whole at the end or never. Each backend supplies
only `send(reader)`, its SDK's own parallel upload of a stream."""

from __future__ import annotations

import io
import os
import threading
import time
from collections import deque
from typing import Callable

from skyspot.errors import StoreError


# What a checkpoint file streams in: parts of this size, this many in flight per file (S3
# multipart parts, GCS composite parts, Azure blocks). 8 ranks per node x 8 parts x 16 MiB keeps
# about 1 GiB in flight per node, which is what saturating a 100 Gbit/s NIC to S3 takes at
# ~80 ms per part request (S3 performance guidelines: 8-16 MB parts, many connections).
STREAM_PART_BYTES = 16 * 1024 * 1024
STREAM_CONCURRENCY = 8
# Chunks below this are copied as they pass (zip headers, pickles); larger ones are kept as views
# of the caller's memory until `release()` (the snapshot buffers: no copy at all).
_STREAM_COPY_BELOW = 1 << 20


class StreamAborted(StoreError):
    """The stream was aborted (superseded, past its deadline, or the writer failed); nothing was committed."""


class Pipe(io.RawIOBase):
    """Bytes from a producer (the checkpoint writer) to an SDK's reader thread, never blocking the producer.

    Large chunks are kept as views of the producer's memory, small ones copied. `release()` turns
    every chunk not yet read into a range of `source` (the local file the producer writes first,
    so it holds those bytes), after which the producer's memory may be reused. `abort()` makes the
    reader fail, so the SDK never completes the object.
    """

    def __init__(self, source: str | os.PathLike | None):
        super().__init__()
        self._source = os.fspath(source) if source is not None else None
        self._cv = threading.Condition()
        self._segments: deque = deque()  # [memoryview] or [(offset, length)] for file ranges
        self._written = 0
        self._read = 0
        self._eof = False
        self._aborted: str | None = None
        self._fd: int | None = None

    # producer side
    def feed(self, data) -> None:
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._cv:
            if self._aborted:
                return
            self._segments.append(view if len(view) >= _STREAM_COPY_BELOW else memoryview(bytes(view)))
            self._written += len(view)
            self._cv.notify_all()

    def end(self) -> None:
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def release(self) -> None:
        """From now on, read what is left from `source`, not from the producer's memory."""
        with self._cv:
            if self._source is None:
                self._segments = deque(memoryview(bytes(s)) if isinstance(s, memoryview) else s for s in self._segments)
                return
            offset = self._read
            ranges: deque = deque()
            for segment in self._segments:
                length = len(segment) if isinstance(segment, memoryview) else segment[1]
                ranges.append((offset, length))
                offset += length
            self._segments = ranges

    def abort(self, reason: str) -> None:
        with self._cv:
            self._aborted = reason
            self._segments.clear()
            self._cv.notify_all()

    @property
    def written(self) -> int:
        return self._written

    @property
    def aborted(self) -> str | None:
        return self._aborted

    @property
    def consumed(self) -> int:
        return self._read

    # reader side (the SDK)
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        with self._cv:
            self._cv.wait_for(lambda: self._segments or self._eof or self._aborted)
            if self._aborted:
                raise StreamAborted(self._aborted)
            if not self._segments:
                return 0  # end of data
            head = self._segments[0]
            if isinstance(head, memoryview):
                n = min(len(out), len(head))
                out[:n] = head[:n]
                if n == len(head):
                    self._segments.popleft()
                else:
                    self._segments[0] = head[n:]
            else:
                offset, length = head
                if self._fd is None:
                    self._fd = os.open(self._source, os.O_RDONLY)
                n = os.preadv(self._fd, [out[: min(len(out), length)]], offset)
                if n <= 0:
                    raise StreamAborted(f"{self._source} is shorter than what was written to it")
                if n == length:
                    self._segments.popleft()
                else:
                    self._segments[0] = (offset + n, length - n)
            self._read += n
            return n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


class StreamUpload:
    """One object uploaded while its bytes are produced: `write` as they come (never blocks on the
    network), `release` before the producer reuses its memory, `finish` to wait until the object is
    whole in the store, `abort` to give up without ever committing it.

    A backend supplies `send(reader)`, which uploads everything `reader` yields to the key with the
    SDK's own parallel machinery and commits the object only at the end of the data; it runs on a
    thread of its own. Errors surface from `finish` as StoreErrors."""

    def __init__(
        self,
        store_uri: str,
        key: str,
        send: Callable[["Pipe"], None],
        source=None,
        on_abort: Callable[[], None] | None = None,
    ):
        self.key = key
        self.where = f"{store_uri}/{key}"
        self._pipe = Pipe(source)
        self._error: BaseException | None = None
        self._on_abort = on_abort
        self.started = time.monotonic()
        self.finished: float | None = None

        def run() -> None:
            try:
                send(self._pipe)
            except BaseException as error:  # surfaces in finish()
                self._error = error
            finally:
                self.finished = time.monotonic()
                self._pipe.close()

        self._thread = threading.Thread(target=run, name=f"skyspot-stream-{key.rsplit('/', 1)[-1]}", daemon=True)
        self._thread.start()

    def write(self, data) -> None:
        self._pipe.feed(data)

    def end(self) -> None:
        """No more data (the producer's file is complete)."""
        self._pipe.end()

    def release(self) -> None:
        self._pipe.release()

    @property
    def bytes(self) -> int:
        return self._pipe.written

    @property
    def sent(self) -> int:
        """Bytes the SDK has taken so far (read from the stream; not necessarily acknowledged)."""
        return self._pipe.consumed

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self, timeout: float | None = None) -> bool:
        """End the data and wait up to `timeout`; True once the object is whole in the store.
        Raises the upload's StoreError (StreamAborted after abort)."""
        self._pipe.end()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._pipe.aborted:
            raise StreamAborted(self._pipe.aborted)
        if self._error is not None:
            error = self._error
            if isinstance(error, StoreError):
                raise error
            cause = next((e for e in (error, error.__cause__, error.__context__) if isinstance(e, StreamAborted)), None)
            if cause is not None:
                raise cause
            raise StoreError(f"cannot upload {self.where}: {type(error).__name__}: {_one_line(error)}")
        return True

    def abort(self, reason: str, wait: float = 0.0) -> None:
        """Stop: the object is never committed (the SDK's read fails; multipart uploads are aborted)."""
        self._pipe.abort(reason)
        if self._on_abort is not None:
            try:
                self._on_abort()
            except Exception:
                pass
        if wait:
            self._thread.join(wait)


def read_full(reader, size: int) -> bytes:
    """Up to `size` bytes from a stream, fewer only at its end."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = reader.readinto(view[got:])
        if not n:
            break
        got += n
    del view
    return bytes(buffer) if got == size else bytes(buffer[:got])


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
