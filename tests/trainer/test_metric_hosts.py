"""A dashboard's token goes only to the host the user's own environment names, and only over https or
loopback (trainer/metrics/hosts.py; issue 31, items 3 and 4). Two loopback HTTP servers stand for the
user's MLflow server and a recipe's: each records the Authorization header of every request it gets."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from typer.testing import CliRunner

from skyspot.cli.main import app
from skyspot.trainer.metrics import hosts
from tests.trainer.test_metrics import RUN, dashboards, start, train  # noqa: F401 - the fixture

TOKEN = "CANARYmlflowToken0123"


class _Recorder(http.server.BaseHTTPRequestHandler):
    def _any(self):
        self.server.seen.append(self.headers.get("Authorization"))
        body = b'{"error_code": "INTERNAL_ERROR", "message": "a stand-in"}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _any

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    made = []
    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        server.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
    yield [(s, f"http://127.0.0.1:{s.server_address[1]}") for s in made]
    for server in made:
        server.shutdown()


def test_the_token_reaches_the_users_server_and_never_the_recipes(servers, dashboards, monkeypatch):  # noqa: F811
    (user, user_uri), (theirs, their_uri) = servers
    monkeypatch.setenv("MLFLOW_TRACKING_URI", user_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    said: list[str] = []
    sink, events = start(dashboards, 1, "mlflow", said=said, extra=[f"metrics.mlflow_tracking_uri={their_uri}"])
    train(events, range(1, 3))
    sink.close(0)
    assert theirs.seen and all(TOKEN not in (h or "") for h in theirs.seen), theirs.seen  # asked, never given it
    assert any("MLFLOW_TRACKING_TOKEN not sent to" in line for line in said), said
    assert not user.seen

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)  # the sink dropped it from this process
    again: list[str] = []
    sink, events = start(dashboards, 2, "mlflow", said=again, extra=[f"metrics.mlflow_tracking_uri={user_uri}"])
    train(events, range(3, 5))
    sink.close(0)
    assert f"Bearer {TOKEN}" in user.seen, again  # the server the user named gets it


def test_a_launch_that_would_send_a_token_elsewhere_is_refused_before_anything_starts(servers, monkeypatch):
    (user, user_uri), (theirs, their_uri) = servers
    monkeypatch.setenv("MLFLOW_TRACKING_URI", user_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    result = CliRunner().invoke(
        app,
        ["launch", "tiny", "--local", "-d", "metrics.backends=[mlflow]", f"metrics.mlflow_tracking_uri={their_uri}"],
    )
    assert result.exit_code == 2 and TOKEN not in result.output
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert f"the recipe's metrics.mlflow_tracking_uri names {their_uri}, but your MLFLOW_TRACKING_URI names" in line
    assert not user.seen and not theirs.seen


@pytest.mark.parametrize(
    "environ, recipe_uri, refused",
    [
        ({"WANDB_API_KEY": "k", "WANDB_BASE_URL": "http://wandb.example.com"}, None, "plain http to another machine"),
        ({"WANDB_API_KEY": "k", "WANDB_BASE_URL": "http://127.0.0.1:8080"}, None, None),  # loopback: fine
        ({"WANDB_API_KEY": "k", "WANDB_BASE_URL": "https://wandb.example.com"}, None, None),
        ({"MLFLOW_TRACKING_TOKEN": "t", "MLFLOW_TRACKING_URI": "http://mlflow.example.com"}, None, "plain http"),
        ({"MLFLOW_TRACKING_TOKEN": "t"}, "https://mlflow.example.com", "your environment names no MLFLOW_TRACKING_URI"),
        ({"MLFLOW_TRACKING_TOKEN": "t", "MLFLOW_TRACKING_URI": "https://a.example.com"}, "https://a.example.com", None),
        ({}, "https://anyone.example.com", None),  # no credential: a recipe may name any server
        ({"MLFLOW_TRACKING_TOKEN": "t"}, "runs/mlruns", None),  # a file store inside the run
        ({}, "../outside", "leaves the run's directory"),
    ],
)
def test_where_a_credential_may_go(environ, recipe_uri, refused):
    backends = ["wandb", "mlflow"]
    if refused is None:
        hosts.check(recipe_uri, backends, environ)
    else:
        with pytest.raises(hosts.HostError, match=refused):
            hosts.check(recipe_uri, backends, environ)


def test_the_hosts_travel_to_the_nodes_beside_their_tokens(monkeypatch):
    from skyspot.app.launch import build

    environ = {
        "WANDB_BASE_URL": "https://wandb.example.com",
        "MLFLOW_TRACKING_URI": "https://ml.example.com",
        "WANDB_API_KEY": "CANARYwandbKey",
    }
    task = build("tiny", ["metrics.backends=[wandb,mlflow]"], environ=environ).task
    assert task["envs"]["WANDB_BASE_URL"] == "https://wandb.example.com"
    assert task["envs"]["MLFLOW_TRACKING_URI"] == "https://ml.example.com"
    assert "WANDB_API_KEY" not in task["envs"] and "CANARY" not in json.dumps(task)  # the key only as a secret
    plain = build("tiny", ["metrics.backends=[mlflow]"], environ={"MLFLOW_TRACKING_URI": "/local/mlruns"}).task
    assert "MLFLOW_TRACKING_URI" not in plain["envs"]  # a file store on this machine is not the node's
