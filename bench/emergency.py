"""Benchmark 8: the emergency checkpoint made durable, and what the upload path costs in CPU.

An S3 server on loopback (moto's server, in a process of its own pinned to one core, the client
pinned to the other: the store behaves like another machine, whose CPU the node does not share;
unpinned, both measurements would mostly measure the two sides fighting over two cores), then,
in one run:

- raw bandwidth: one large parallel transfer of the checkpoint's bytes from memory, straight
  through the AWS Common Runtime's S3 client (awscrt, via s3transfer's CRTTransferManager), the
  fastest way the SDK offers. Floor = bytes / that bandwidth;
- streamed (skyspot): `bench/_emergency_worker.py` on 2 ranks with a state of about 2.2 GB per
  node (`--quick`: 0.31 GB): SIGTERM mid-step, the step finishes, the checkpoint streams to the
  store while it is written, durable when the node's marker is up. The trainer's own
  `emergency_checkpoint` event gives signal -> durable (`notice_to_safe_seconds`);
- sequential (before this change): the same with SKYSPOT_STREAM_UPLOADS=0, the local write first,
  then the upload of the committed files;
- CPU: the client process's CPU time (user + system, all threads) per GB for skyspot's stream
  (`S3Store.open_stream` fed from memory, as the writer feeds it) through the CRT client and
  through boto3's classic TransferManager, for the CRT client reading a file itself (no Python in
  the data path), and for the kernel alone (`sendall` of the same bytes to a loopback socket that
  discards them), which no HTTP client can beat on this machine; plus what this machine's memory
  copy, CRC32 and sha256 cost per GB, to read the figures by.

Goals (issue 15): signal -> durable <= 1.25x floor + 1 s; upload path <= 0.3 core-s per GB.
"""

from __future__ import annotations

import io
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._launch import LARGE, LARGE_QUICK, bench_env, ensure_shm_op, free_port, run_worker
from bench.common import Figure, Results

GOAL_RATIO, GOAL_FIXED_S = 1.25, 1.0
GOAL_CPU = 0.3
# About 2.2 GB per node: the LARGE Llama with 14 layers (180M parameters x 12 bytes).
STATE = [
    o if not o.startswith("model.config.num_hidden_layers") else "model.config.num_hidden_layers=14" for o in LARGE
]
BUCKET = "bench-emergency"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _moto(port: int, log: Path) -> subprocess.Popen:
    pin = (lambda: os.sched_setaffinity(0, SERVER_CPUS)) if len(os.sched_getaffinity(0)) > 1 else None
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=bench_env(),
        preexec_fn=pin,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not start; see {log}")


def _socket_floor(data: bytes) -> tuple[float, float]:
    """(seconds, client CPU seconds) to push `data` through a loopback TCP socket to a discarding reader
    thread: the kernel's share of any upload. The reader's CPU is in this process too, so half is
    charged (a server on another machine would pay it)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def drain():
        conn, _ = server.accept()
        buf = bytearray(1 << 20)
        while conn.recv_into(buf):
            pass
        conn.close()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    client = socket.create_connection(server.getsockname())
    cpu, start = _cpu(), time.perf_counter()
    client.sendall(memoryview(data))
    client.close()
    reader.join()
    server.close()
    return time.perf_counter() - start, (_cpu() - cpu) / 2


CLIENT_CPUS, SERVER_CPUS = {0}, {1}


def _costs() -> dict[str, float]:
    """Seconds per GB of this machine's building blocks (one core): memory copy, CRC32 (awscrt), sha256."""
    import hashlib

    data = os.urandom(256 << 20)
    out = {}
    for name, fn in (
        ("copy", lambda: bytearray(data)),
        ("crc32", lambda: _crc32(data)),
        ("sha256", lambda: hashlib.sha256(data).digest()),
    ):
        start = time.perf_counter()
        fn()
        out[name] = (time.perf_counter() - start) / (len(data) / 1e9)
    return out


def _crc32(data: bytes) -> int:
    try:
        from awscrt import checksums

        return checksums.crc32(data)
    except ImportError:
        import zlib

        return zlib.crc32(data)


def run(results: Results, quick: bool) -> None:
    import boto3

    from skyspot.storage import S3Store, _crt_transfer_manager, open_store

    ensure_shm_op(results)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    saved = {k: os.environ.get(k) for k in [*env, "SKYSPOT_S3_CLIENT"]}
    os.environ.update(env)
    tmp = Path(tempfile.mkdtemp(prefix="skyspot-bench-emergency-"))
    server = _moto(port, Path(tempfile.gettempdir()) / "skyspot-bench-moto.log")
    affinity = os.sched_getaffinity(0)
    client_cpus = CLIENT_CPUS if len(affinity) > 1 else None
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        overrides = LARGE_QUICK if quick else STATE

        # 1. skyspot, streamed, then 2. the sequential path of before, each a fresh trainer.
        found = {}
        for variant, extra in (("streamed", {}), ("sequential", {"SKYSPOT_STREAM_UPLOADS": "0"})):
            log = Path(tempfile.gettempdir()) / f"skyspot-bench-emergency-{variant}.log"
            start = time.time()
            out = run_worker(
                "bench._emergency_worker",
                ["--run-dir", str(tmp / variant), "--store", f"s3://{BUCKET}/{variant}", *overrides],
                timeout=1800,
                log=log,
                env=bench_env(**env, **extra),
                cpus=client_cpus,
            )
            found[variant] = out
            print(f"   emergency {variant}: {time.time() - start:.0f}s", file=sys.stderr, flush=True)
            _empty(client, f"{variant}/")
        e = found["streamed"]["emergency"]
        nbytes = int(e["bytes"])

        # 3. raw bandwidth of the same store: one large parallel transfer of as many bytes, from memory.
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        data = os.urandom(nbytes)
        store = open_store(f"s3://{BUCKET}/raw")
        manager = _crt_transfer_manager(store._s3())
        cpu, start = _cpu(), time.perf_counter()
        manager.upload(io.BytesIO(data), BUCKET, "raw/one-object").result()
        raw_s, raw_cpu = time.perf_counter() - start, _cpu() - cpu
        _empty(client, "raw/")

        # 4. CPU per GB: skyspot's stream path (views of memory, as the writer feeds it), CRT and classic.
        cpu_figures = {}
        for label, choice in (("skyspot stream (CRT)", "crt"), ("skyspot stream (classic TransferManager)", "classic")):
            os.environ["SKYSPOT_S3_CLIENT"] = choice
            stream_store = S3Store(BUCKET, f"cpu-{choice}")
            stream_store._streams()  # set-up is not part of a transfer
            cpu, start = _cpu(), time.perf_counter()
            stream = stream_store.open_stream("one-object")
            view = memoryview(data)
            for offset in range(0, len(view), 64 << 20):
                stream.write(view[offset : offset + (64 << 20)])
            assert stream.finish(timeout=1800)
            cpu_figures[label] = ((_cpu() - cpu) / (nbytes / 1e9), nbytes / (time.perf_counter() - start))
            _empty(client, f"cpu-{choice}/")
        # the CRT client reading a file by itself: no Python between the file and the network
        source = tmp / "one-object"
        source.write_bytes(data)
        cpu, start = _cpu(), time.perf_counter()
        manager.upload(str(source), BUCKET, "file/one-object").result()
        cpu_figures["CRT client reading a file itself (reference)"] = (
            (_cpu() - cpu) / (nbytes / 1e9),
            nbytes / (time.perf_counter() - start),
        )
        _empty(client, "file/")
        source.unlink()
        sock_s, sock_cpu = _socket_floor(data)
        del data
        costs = _costs()
    finally:
        os.sched_setaffinity(0, affinity)
        server.kill()
        server.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    raw_bps = nbytes / raw_s
    floor = nbytes / raw_bps
    goal = GOAL_RATIO * floor + GOAL_FIXED_S
    size = f"{nbytes / 1e9:.2f} GB/node"
    results.add(
        Figure(
            "emergency",
            f"raw store bandwidth: one parallel CRT transfer ({size})",
            "MB/s",
            [raw_bps / 1e6],
            note=f"moto's S3 server on loopback; floor = {floor:.1f} s; "
            f"{raw_cpu / (nbytes / 1e9):.2f} core-s/GB in the client",
        )
    )
    for variant in ("streamed", "sequential"):
        ev, up = found[variant]["emergency"], found[variant].get("upload") or {}
        total = ev.get("notice_to_safe_seconds")
        durable = ev.get("durable_before_deadline")
        parts = (
            f"commit {ev['signal_to_commit_seconds']:.1f} s after the signal (step in flight, snapshot, "
            f"write {ev['write_seconds']:.1f} s); durable {ev.get('save_to_safe_seconds')} s after the save "
            f"began; {up.get('streamed_bytes', 0) / 1e9:.2f} GB streamed"
        )
        if variant == "streamed":
            met = bool(durable) and total is not None and total <= goal
            why = "" if met else f"; missed: see docs/benchmarks.md ({total} s against {goal:.1f} s)"
            results.add(
                Figure(
                    "emergency",
                    f"signal -> durable, skyspot streaming ({size})",
                    "s",
                    [total if total is not None else float("nan")],
                    goal=f"<= {GOAL_RATIO}x floor + {GOAL_FIXED_S:g} s = {goal:.1f} s",
                    met=met,
                    note=parts + why,
                )
            )
        else:
            results.add(
                Figure(
                    "emergency",
                    f"signal -> durable, write then upload (before) ({size})",
                    "s",
                    [total if total is not None else float("nan")],
                    note=parts,
                )
            )
    streamed, sequential = (found[v]["emergency"].get("notice_to_safe_seconds") for v in ("streamed", "sequential"))
    if streamed and sequential:
        results.add(
            Figure(
                "emergency",
                "signal -> durable, streamed / sequential",
                "x",
                [streamed / sequential],
                note=f"{streamed:.1f} s against {sequential:.1f} s in the same run",
            )
        )
    sock_per_gb = sock_cpu / (nbytes / 1e9)
    machine = (
        f"this machine per GB: memory copy {costs['copy']:.2f} s, CRC32 {costs['crc32']:.2f} s, sha256 "
        f"{costs['sha256']:.2f} s, the kernel's send (loopback, sender's half) {sock_per_gb:.2f} s"
    )
    for label, (per_gb, bps) in cpu_figures.items():
        reference = "reference" in label
        results.add(
            Figure(
                "emergency",
                f"upload CPU, {label}",
                "core-s/GB",
                [per_gb],
                goal=None if reference else f"<= {GOAL_CPU}",
                met=None if reference else per_gb <= GOAL_CPU,
                note=f"{bps / 1e6:.0f} MB/s" + ("" if reference else f"; {machine}"),
            )
        )


def _empty(client, prefix: str) -> None:
    """Delete what a measurement left: moto keeps every object in memory."""
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        for o in page.get("Contents", ())
    ]
    for start in range(0, len(keys), 1000):
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]]})
