"""A fake Hugging Face hub on loopback, so no test ever reaches huggingface.co.

It answers the two questions skyspot asks before a run (hub.py): `GET /api/models/<repo>[/revision/<rev>]`
and `GET /api/datasets/<repo>`, with the status codes and `X-Error-Code` headers the real hub uses
(huggingface_hub's `hf_raise_for_status` turns them into GatedRepoError, RepositoryNotFoundError,
RevisionNotFoundError). It knows the registry recipes' models and datasets; a gated model answers
403 GatedRepo without a token, or with the token DENIED_TOKEN.

Every test runs with HF_ENDPOINT pointing here (the autouse fixture below); a test that needs the
hub unreachable points HF_ENDPOINT at a closed port instead.

`FakeHub.serve(repo, directory)` also serves a directory's files as a model repository at COMMIT, the
way `snapshot_download` fetches them (`HEAD`/`GET /<repo>/resolve/<revision>/<file>`, with the
X-Repo-Commit and ETag headers huggingface_hub reads), so a test can download a real model from here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

DENIED_TOKEN = "hf_no_access"
COMMIT = "a" * 40
WEIGHTS = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "original/consolidated.00.pth",
]

MODELS = {
    "meta-llama/Llama-3.1-8B": {"gated": "manual", "files": WEIGHTS},
    "meta-llama/Llama-3.1-70B": {"gated": "manual", "files": WEIGHTS},
    "HuggingFaceTB/SmolLM2-360M": {"gated": False, "files": ["config.json", "model.safetensors", "tokenizer.json"]},
    "acme/bin-only": {"gated": False, "files": ["config.json", "pytorch_model.bin"]},
}
REVISIONS = {"main", COMMIT}
DATASETS = {"yahma/alpaca-cleaned": {"gated": False}}
SERVED: dict[str, Path] = {}  # repo -> the directory FakeHub.serve() publishes as that repository


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: dict, error_code: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
        self.end_headers()
        self.wfile.write(data)

    def _file(self, head: bool) -> bool:
        """`/<repo>/resolve/<revision>/<file>` of a served repository; False when the path is not one."""
        path = unquote(urlparse(self.path).path).lstrip("/")
        repo, sep, rest = path.partition("/resolve/")
        if not sep or repo not in SERVED:
            return False
        revision, _, name = rest.partition("/")
        file = SERVED[repo] / name
        if revision not in REVISIONS or not file.is_file():
            self._send(404, {"error": "Entry not found"}, "EntryNotFound")
            return True
        data = file.read_bytes()
        start = 0
        ranged = (self.headers.get("Range") or "").removeprefix("bytes=").partition("-")[0]
        if ranged.isdigit() and int(ranged) < len(data):
            start = int(ranged)
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.end_headers()
        if not head:
            self.wfile.write(data[start:])
        return True

    def do_HEAD(self):  # noqa: N802 - http.server's name
        if not self._file(head=True):
            self._send(404, {"error": "not found"})

    def do_GET(self):  # noqa: N802 - http.server's name
        if self._file(head=False):
            return
        path = unquote(urlparse(self.path).path)
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        for kind, known in (("models", MODELS), ("datasets", DATASETS)):
            prefix = f"/api/{kind}/"
            if not path.startswith(prefix):
                continue
            repo, _, revision = path[len(prefix) :].partition("/revision/")
            info = known.get(repo)
            if kind == "models" and repo in SERVED:
                info = {"gated": False, "files": sorted(p.name for p in SERVED[repo].iterdir() if p.is_file())}
            if info is None:
                return self._send(401, {"error": "Repository Not Found"}, "RepoNotFound")
            if revision and revision not in REVISIONS:
                return self._send(404, {"error": "Invalid rev id"}, "RevisionNotFound")
            if info["gated"] and (not token or token == DENIED_TOKEN):
                return self._send(403, {"error": "Access to this model is restricted"}, "GatedRepo")
            return self._send(
                200,
                {
                    "id": repo,
                    "sha": COMMIT,
                    "private": False,
                    "gated": info["gated"],
                    "siblings": [{"rfilename": f} for f in info.get("files", [])],
                },
            )
        self._send(404, {"error": "not found"})


class FakeHub:
    def __init__(self):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def serve(self, repo: str, directory: Path) -> None:
        """Publish `directory`'s files as model repository `repo` (every revision in REVISIONS)."""
        SERVED[repo] = Path(directory)

    def withdraw(self, repo: str) -> None:
        """Stop serving `repo` (the server is shared by the whole session)."""
        SERVED.pop(repo, None)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def fake_hub():
    hub = FakeHub()
    yield hub
    hub.stop()


@pytest.fixture(autouse=True)
def _hub_is_the_fake(fake_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-hf-token"))  # not the machine's `huggingface-cli login`
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield
