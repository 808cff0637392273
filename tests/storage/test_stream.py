"""skyspot.storage.stream: a stream becomes one whole object, from memory and then the local file, or never."""

from __future__ import annotations

import os

import pytest

from skyspot.storage import open_store


# --------------------------------------------------------------------------- streaming uploads


def _stream_through(store, key: str, data: bytes, source, *, release_at: int) -> None:
    """Feed `data` as a writer does: the local file first, then the stream, a view of the caller's
    memory for big chunks; at `release_at` the memory is released and then scribbled over, so what
    follows must come from the file."""
    buffer = bytearray(data)
    stream = store.open_stream(key, source=source)
    with open(source, "wb", buffering=0) as f:
        for start in range(0, len(buffer), 3 * 1024 * 1024 + 17):
            chunk = memoryview(buffer)[start : start + 3 * 1024 * 1024 + 17]
            f.write(chunk)
            stream.write(chunk)
            stream.write(b"")  # empty writes are nothing
    stream.end()
    if release_at:
        stream.release()
        buffer[:] = b"\0" * len(buffer)  # the snapshot buffers being reused by the next checkpoint
    assert stream.finish(timeout=120)
    assert stream.bytes == len(data)


def test_a_stream_becomes_one_whole_object_from_memory_and_the_local_file(store, tmp_path):
    data = os.urandom(34 * 1024 * 1024 + 5)  # three 16 MiB parts (S3 parts, GCS composite parts, Azure blocks)
    _stream_through(store, "ckpt/step_1/shard.pt", data, tmp_path / "shard.pt", release_at=1)
    store.get_file("ckpt/step_1/shard.pt", tmp_path / "back.pt")
    assert (tmp_path / "back.pt").read_bytes() == data
    assert store.list("ckpt/") == ["ckpt/step_1/shard.pt"]  # no temporary parts left behind

    empty = store.open_stream("ckpt/step_1/empty.pt", source=tmp_path / "empty.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    assert empty.finish(timeout=60) and store.get_bytes("ckpt/step_1/empty.pt") == b""


def test_an_aborted_stream_never_becomes_an_object(store, tmp_path):
    from skyspot.storage import StreamAborted

    stream = store.open_stream("ckpt/step_2/shard.pt", source=tmp_path / "x")
    stream.write(os.urandom(20 * 1024 * 1024))
    stream.abort("superseded by step 3", wait=30)
    with pytest.raises(StreamAborted, match="superseded by step 3"):
        stream.finish(timeout=30)
    assert not store.exists("ckpt/step_2/shard.pt")


@pytest.mark.parametrize("client", ["crt", "classic"])
def test_s3_streams_through_the_crt_client_or_the_classic_transfer_manager(s3_server, client, monkeypatch, tmp_path):
    pytest.importorskip("awscrt") if client == "crt" else None
    monkeypatch.setenv("SKYSPOT_S3_CLIENT", client)
    store = open_store(s3_server.bucket() + "/runs")
    data = os.urandom(17 * 1024 * 1024)
    _stream_through(store, "k.bin", data, tmp_path / "k.bin", release_at=0)
    assert store.stream_client == client and store.get_bytes("k.bin") == data
