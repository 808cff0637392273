"""Where the dashboards' credentials may go: only to the host the user's own environment names for them.

A token travels with its host. W&B's key (WANDB_API_KEY) goes to WANDB_BASE_URL (default W&B's own
service); MLflow's credentials (MLFLOW_TRACKING_TOKEN, or USERNAME/PASSWORD) go to MLFLOW_TRACKING_URI.
Both variables are the user's environment, on the launching machine; the launch sends them to the nodes
beside the token (cloud: the task's envs; local: the node's environment). A recipe is a shared file: it
may name an MLflow server (`metrics.mlflow_tracking_uri`) only where no credential would go to it, or
where it is the very server the environment names; otherwise the launch refuses in one line, and the
trainer (on the node) drops the credentials before it talks to that server. A credential never goes over
plain http except to a loopback address.

A relative `metrics.mlflow_tracking_uri` is a file store inside the run (`<run dir>/<path>`), kept in the
run's store like the default `mlruns` (to_mlflow.py), on every executor alike.

Plain functions over a mapping of the environment, so the launch, the node and the tests ask one place.
"""

from __future__ import annotations

import ipaddress
from pathlib import PurePosixPath
from typing import Mapping, Optional
from urllib.parse import urlparse

WANDB_KEY = "WANDB_API_KEY"
WANDB_HOST = "WANDB_BASE_URL"
WANDB_DEFAULT_HOST = "https://api.wandb.ai"  # wandb's own default base_url (wandb/sdk/wandb_settings.py)
MLFLOW_HOST = "MLFLOW_TRACKING_URI"
# MLflow's credential variables (mlflow/environment_variables.py: MLFLOW_TRACKING_TOKEN, _USERNAME, _PASSWORD).
MLFLOW_CREDENTIALS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


class HostError(ValueError):
    """A credential would go where the user's environment did not send it (one line)."""


def origin(uri: str) -> Optional[tuple[str, str, int]]:
    """(scheme, host, port) of a server URI, or None for a file store or a URI without a host."""
    parsed = urlparse(uri.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return None
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return None
    return parsed.scheme, parsed.hostname.lower(), port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_file_store(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


def run_relative(uri: str) -> Optional[str]:
    """The path inside the run a relative file store names (`mlruns-x`, `./a/b`), or None when `uri` is
    not a relative path. Raises HostError for a path that leaves the run (`..`)."""
    if urlparse(uri).scheme or uri.startswith(("/", "~")):
        return None
    parts = [p for p in PurePosixPath(uri).parts if p != "."]
    if not parts:
        raise HostError(f"metrics.mlflow_tracking_uri '{uri}' names no directory: name one inside the run, or a server")
    if ".." in parts:
        raise HostError(
            f"metrics.mlflow_tracking_uri '{uri}' leaves the run's directory: a relative file store "
            "is kept inside the run; name a path without '..'"
        )
    return "/".join(parts)


def _plain_http(uri: str) -> bool:
    found = origin(uri)
    return found is not None and found[0] == "http" and not is_loopback(found[1])


def mlflow_credentials(environ: Mapping[str, str]) -> list[str]:
    return [name for name in MLFLOW_CREDENTIALS if environ.get(name)]


def check(recipe_uri: Optional[str], backends, environ: Mapping[str, str]) -> None:
    """Refuse (HostError, one line) a launch whose dashboards would send a credential to a host the
    user's environment did not name, or over plain http beyond loopback."""
    if "wandb" in backends and environ.get(WANDB_KEY):
        host = environ.get(WANDB_HOST) or WANDB_DEFAULT_HOST
        if _plain_http(host):
            raise HostError(
                f"{WANDB_HOST}={host} is plain http to another machine: {WANDB_KEY} would cross the "
                "network readable; use https (plain http only to a loopback address)"
            )
    if "mlflow" not in backends:
        return
    if recipe_uri:
        run_relative(recipe_uri)  # its own refusals
    credentials = mlflow_credentials(environ)
    if not credentials:
        return
    user = environ.get(MLFLOW_HOST) or ""
    target = recipe_uri or user
    if recipe_uri and not is_file_store(recipe_uri) and origin(recipe_uri) != origin(user):
        named = f"your {MLFLOW_HOST} names {user}" if user else f"your environment names no {MLFLOW_HOST}"
        raise HostError(
            f"the recipe's metrics.mlflow_tracking_uri names {recipe_uri}, but {named}: "
            f"{credentials[0]} goes only to the server your environment names; set "
            f"{MLFLOW_HOST}={recipe_uri} if you mean it, or unset {credentials[0]}"
        )
    if target and _plain_http(target):
        raise HostError(
            f"MLflow server {target} is plain http to another machine: {credentials[0]} would cross "
            "the network readable; use https (plain http only to a loopback address)"
        )


def node_envs(backends, environ: Mapping[str, str]) -> dict[str, str]:
    """The hosts that travel to the nodes beside their tokens (a file store on this machine does not:
    the node keeps its own in the run's store)."""
    envs = {}
    if "wandb" in backends and environ.get(WANDB_HOST):
        envs[WANDB_HOST] = environ[WANDB_HOST]
    user = environ.get(MLFLOW_HOST) or ""
    if "mlflow" in backends and user and not is_file_store(user):
        envs[MLFLOW_HOST] = user
    return envs


def drop_stray_credentials(server_uri: str, environ) -> list[str]:
    """On the node: remove MLflow's credentials from `environ` (os.environ) when the server the trainer
    is about to use is not the one MLFLOW_TRACKING_URI names, or is plain http beyond loopback; the
    names removed. MLflow reads them from the environment at each request, so nothing else carries them."""
    credentials = mlflow_credentials(environ)
    if not credentials or is_file_store(server_uri):
        return []
    if origin(server_uri) == origin(environ.get(MLFLOW_HOST) or "") and not _plain_http(server_uri):
        return []
    for name in credentials:
        environ.pop(name, None)
    return credentials
