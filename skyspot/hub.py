"""The Hugging Face hub as skyspot uses it: model and dataset references, offline mode, access checks.

A model reference (`model.hub_id`, `model.tokenizer`) is a hub id (`org/name`) or a local directory,
given as an absolute path (or `~/...`). Every problem a start would otherwise meet minutes later, on
a paid node, deep inside a download that retries, is told here in one line (a `UsageError`):

    check_model("meta-llama/Llama-3.1-8B", revision=None, gated=True, environ=os.environ)
    #  UsageError: meta-llama/Llama-3.1-8B is gated: export HF_TOKEN=hf_... (a token of an account ...)

The environment decides, as huggingface_hub itself does: `HF_HUB_OFFLINE=1` never touches the
network (the local cache must hold what is needed), `HF_TOKEN` (or the token file `huggingface-cli
login` wrote) authenticates, `HF_ENDPOINT` names the hub, `HF_HOME` / `HF_HUB_CACHE` the cache.

Import-light: the CLI imports this at launch; huggingface_hub is imported inside the functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from skyspot.errors import UsageError

DEFAULT_ENDPOINT = "https://huggingface.co"
# How long one question to the hub may take before the start gives up on it: a hub that does not
# answer within this is as good as unreachable for a run that is about to pay for GPUs.
HUB_TIMEOUT_S = 15.0

# What a run needs of a hub model repository, and what it never needs. Llama repositories also ship
# the original consolidated checkpoints (original/*.pth, as large as the safetensors).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
LIGHT_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # everything but the weights
IGNORED_FILES = ["original/*", "*.pth", "*.bin", "*.pt", "*.gguf", "*.onnx", "*.h5", "*.msgpack"]


def is_local_ref(value: str) -> bool:
    """A local directory rather than a hub id: an absolute path or one under ~."""
    return value.startswith(("/", "~"))


def _true(value: Optional[str]) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")  # huggingface_hub's reading


def offline(environ: Mapping[str, str] = os.environ) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: nothing may reach the hub."""
    return _true(environ.get("HF_HUB_OFFLINE")) or _true(environ.get("TRANSFORMERS_OFFLINE"))


def token(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """HF_TOKEN, else the token file under HF_HOME that `huggingface-cli login` writes."""
    value = (environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN") or "").strip()
    if value:
        return value
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    path = Path(environ.get("HF_TOKEN_PATH") or os.path.join(home, "token"))
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The hub cache huggingface_hub uses under this environment."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def endpoint(environ: Mapping[str, str] = os.environ) -> str:
    return (environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def network_reason(error: BaseException) -> str:
    """A few words for why the hub could not be reached (the libraries' messages run to lines)."""
    text = f"{type(error).__name__}: {error}"
    for needle, reason in (
        ("NameResolution", "the host name does not resolve"),
        ("Name or service not known", "the host name does not resolve"),
        ("Temporary failure in name resolution", "the host name does not resolve"),
        ("nodename nor servname", "the host name does not resolve"),
        ("Connection refused", "connection refused"),
        ("ConnectionRefused", "connection refused"),
        ("Network is unreachable", "the network is unreachable"),
        ("timed out", f"no answer within {HUB_TIMEOUT_S:.0f} s"),
        ("Timeout", f"no answer within {HUB_TIMEOUT_S:.0f} s"),
        ("SSL", "the TLS handshake failed"),
    ):
        if needle in text:
            return reason
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 160 else first[:157] + "..."


def is_network_error(error: BaseException) -> bool:
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(
        names
        & {
            "ConnectionError",
            "Timeout",
            "ConnectTimeout",
            "ReadTimeout",
            "TimeoutException",
            "ConnectError",
            "NetworkError",
            "ProxyError",
            "SSLError",
            "TimeoutError",
            "OfflineModeIsEnabled",
        }
    )


def unreachable(what: str, environ: Mapping[str, str], error: BaseException) -> UsageError:
    return UsageError(
        f"cannot reach the Hugging Face hub at {endpoint(environ)} for {what} ({network_reason(error)}); check the "
        "network, or set HF_HUB_OFFLINE=1 to use the local cache, or give a local directory (an absolute path)"
    )


# --------------------------------------------------------------------------- local directories


def check_local_model(path: str, *, need_weights: bool = True) -> None:
    """A local model directory that from_pretrained (and skyspot's ZeRO-3 loader) can read."""
    directory = Path(path)
    if not directory.is_dir():
        raise UsageError(
            f"model.hub_id {path} is not a directory on this machine; a local model is a directory "
            "that save_pretrained wrote (config.json and *.safetensors)"
        )
    if not (directory / "config.json").is_file():
        raise UsageError(
            f"model.hub_id {path} has no config.json; a local model is a directory that save_pretrained wrote"
        )
    if need_weights and not any(directory.glob("*.safetensors")):
        raise UsageError(
            f"model.hub_id {path} has no *.safetensors weights (save_pretrained(..., "
            "safe_serialization=True) writes them)"
        )


def check_local_tokenizer(path: str) -> None:
    directory = Path(path)
    names = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "skyspot_tokenizer.json"}
    if not directory.is_dir():
        raise UsageError(f"model.tokenizer {path} is not a directory on this machine")
    if not any((directory / n).is_file() for n in names):
        raise UsageError(
            f"model.tokenizer {path} holds no tokenizer (tokenizer.json or tokenizer_config.json, "
            "as save_pretrained writes them)"
        )


def local_config(ref: Optional[str]) -> Optional[dict[str, Any]]:
    """config.json of a local model directory, or None (a hub id, or unreadable)."""
    if not ref or not is_local_ref(ref):
        return None
    try:
        config = json.loads((Path(os.path.expanduser(ref)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# --------------------------------------------------------------------------- the hub


def _cached(repo: str, revision: Optional[str], environ: Mapping[str, str], repo_type: str = "model") -> bool:
    from huggingface_hub import try_to_load_from_cache

    filename = "config.json" if repo_type == "model" else "README.md"
    found = try_to_load_from_cache(
        repo, filename, cache_dir=str(cache_dir(environ)), revision=revision, repo_type=repo_type
    )
    if isinstance(found, str):
        return True
    # A dataset cached without a card still has a snapshot directory.
    folder = cache_dir(environ) / f"{repo_type}s--{repo.replace('/', '--')}" / "snapshots"
    return repo_type != "model" and folder.is_dir() and any(folder.iterdir())


def check_model(
    repo: str,
    *,
    revision: Optional[str],
    gated: bool,
    environ: Mapping[str, str] = os.environ,
    what: str = "model.hub_id",
    need_weights: bool = True,
) -> None:
    """The hub model can be loaded from here, or a UsageError that says why, in one line.

    Offline: the cache must hold it. Online: the hub is asked once (with a short timeout) whether
    the repository and revision exist, whether this token may read them, and whether it has
    safetensors weights.
    """
    label = f"{repo}" + (f"@{revision}" if revision else "")
    if offline(environ):
        if not _cached(repo, revision, environ):
            raise UsageError(
                f"HF_HUB_OFFLINE is set and {what} {label} is not in the Hugging Face cache "
                f"({cache_dir(environ)}): download it once with the network on "
                f"(`huggingface-cli download {repo}`), or give a local directory"
            )
        return
    hf_token = token(environ)
    if gated and not hf_token:
        raise UsageError(_gated_line(repo, what))
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=endpoint(environ), token=hf_token or False)
    try:
        info = api.model_info(repo, revision=revision, timeout=HUB_TIMEOUT_S, token=hf_token or False)
    except GatedRepoError:
        raise UsageError(_gated_line(repo, what, have_token=bool(hf_token))) from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"{what} {repo}: no such model on {endpoint(environ)}"
            + (" (or HF_TOKEN's account cannot see it)" if hf_token else " (or it is private: export HF_TOKEN)")
        ) from None
    except RevisionNotFoundError:
        raise UsageError(f"model.revision {revision!r} does not exist in {repo}") from None
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status == 401:
            raise UsageError(
                f"{what} {repo}: the hub refused HF_TOKEN (401): the token is invalid or expired"
            ) from None
        raise UsageError(
            f"{what} {repo}: the hub answered {status or 'an error'} ({str(err).splitlines()[0][:120]})"
        ) from None
    except Exception as err:  # noqa: BLE001 - the network's many ways to fail
        if is_network_error(err):
            raise unreachable(f"{what} {repo}", environ, err) from None
        raise
    if getattr(info, "gated", False) and not hf_token:
        raise UsageError(_gated_line(repo, what) + "; set model.gated: true so launch passes HF_TOKEN to the task")
    files = [s.rfilename for s in (info.siblings or [])]
    if need_weights and files and not any(f.endswith(".safetensors") and "/" not in f for f in files):
        raise UsageError(
            f"{what} {repo} has no safetensors weights at its top level (skyspot loads only "
            "*.safetensors); convert it, or pick a repository that has them"
        )


def _gated_line(repo: str, what: str, have_token: bool = False) -> str:
    if have_token:
        return (
            f"{what} {repo} is gated and HF_TOKEN's account has no access: accept its licence at "
            f"https://huggingface.co/{repo} with that account"
        )
    return (
        f"{what} {repo} is gated: export HF_TOKEN=hf_... (a token of an account that accepted the licence "
        f"at https://huggingface.co/{repo})"
    )


def check_dataset(repo: str, *, environ: Mapping[str, str] = os.environ) -> None:
    """The hub dataset exists and this token may read it (its fields are checked where it is loaded)."""
    if offline(environ):
        if not _cached(repo, None, environ, repo_type="dataset"):
            raise UsageError(
                f"HF_HUB_OFFLINE is set and the dataset {repo} is not in the Hugging Face cache "
                f"({cache_dir(environ)}); give data.source a local file, or download it once"
            )
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    hf_token = token(environ)
    try:
        HfApi(endpoint=endpoint(environ)).dataset_info(repo, timeout=HUB_TIMEOUT_S, token=hf_token or False)
    except GatedRepoError:
        raise UsageError(_gated_line(repo, "data.source", have_token=bool(hf_token))) from None
    except RepositoryNotFoundError:
        raise UsageError(f"data.source hf://{repo}: no such dataset on {endpoint(environ)}") from None
    except HfHubHTTPError as err:
        raise UsageError(
            f"data.source hf://{repo}: the hub answered "
            f"{getattr(getattr(err, 'response', None), 'status_code', None) or 'an error'}"
        ) from None
    except Exception as err:  # noqa: BLE001
        if is_network_error(err):
            raise unreachable(f"data.source hf://{repo}", environ, err) from None
        raise
