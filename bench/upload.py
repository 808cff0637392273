"""Upload throughput to the S3 server on loopback: skyspot's uploader against single-stream put_object.

Report only, no goal: on loopback both sides share the same 2 cores.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.common import Figure, Results


def run(results: Results, quick: bool) -> None:
    import hashlib
    import json

    import boto3
    from moto.server import ThreadedMotoServer

    from skyspot.storage import open_store
    from skyspot.trainer.uploader import Uploader

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request to stderr
    size_mb = 64 if quick else 256
    repeats = 2 if quick else 3
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_EC2_METADATA_DISABLED",
        )
    }
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench-bucket")
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "step_1"
            ckpt.mkdir()
            files = {}
            for i in range(4):  # four shards, like 4 ranks' optimizer states
                data = os.urandom(size_mb * 2**20 // 4)
                (ckpt / f"shard_{i}.pt").write_bytes(data)
                files[f"shard_{i}.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            (ckpt / "manifest.json").write_text(json.dumps({"step": 1, "files": files}))
            (ckpt / "COMMITTED").write_text("1")
            total = sum(f["size"] for f in files.values())

            def single_stream():
                for name in files:
                    client.put_object(Bucket="bench-bucket", Key=f"single/{name}", Body=(ckpt / name).read_bytes())

            ours, base = [], []
            for r in range(repeats):
                start = time.perf_counter()
                single_stream()
                base.append(total / (time.perf_counter() - start) / 1e6)
                uploader = Uploader(open_store("s3://bench-bucket"), f"run-{r}", keep=None)
                start = time.perf_counter()
                uploader.submit(1, ckpt)
                assert uploader.wait(timeout=600) and uploader.is_durable(1)
                ours.append(total / (time.perf_counter() - start) / 1e6)
                uploader.close()
            results.add(Figure("upload", f"single-stream put_object ({total / 1e6:.0f} MB)", "MB/s", base))
            ratio = sorted(ours)[len(ours) // 2] / sorted(base)[len(base) // 2]
            results.add(
                Figure(
                    "upload",
                    f"skyspot uploader ({total / 1e6:.0f} MB)",
                    "MB/s",
                    ours,
                    note=f"{ratio:.2f}x single-stream (loopback, CPU-bound)",
                )
            )
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
