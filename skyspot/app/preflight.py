"""Preflight: what would make a run fail at its start, found before anything is paid for.

    preflight(recipe, local=True)      # raises UsageError: one line, exit 2 in the CLI

`skyspot launch` calls it before it records or submits a run (app/launch.py prepare); `--dry-run` too,
with `network=False`: what needs neither the network nor a token (this machine's model directories and
data files, a held-out file that copies the training data) is checked the same, the hub is not asked. The trainer meets the same problems in the same words at its own start
(base.py, data.py), so a run that gets past launch and still lacks something fails there once,
with exit 2, which the local executor does not retry.

Checked: a gated model without HF_TOKEN; a hub that cannot be reached (or HF_HUB_OFFLINE without
the model in the cache); a model, revision or dataset that does not exist or this token cannot
read; a local model directory or data file that is missing; a data file whose first record lacks
the fields its format needs. A cloud launch cannot use this machine's files: a local model
directory or data file is refused there.

Import-light: huggingface_hub is imported only when the hub is asked.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional

from skyspot.errors import UsageError

if TYPE_CHECKING:
    from skyspot.recipe import DataSection, Recipe


def preflight(
    recipe: Recipe, *, local: bool, environ: Optional[Mapping[str, str]] = None, network: bool = True
) -> None:
    """Raise UsageError for the first thing that would fail the run's start (`network`: ask the hub too)."""
    from skyspot import hub

    environ = os.environ if environ is None else environ
    model = recipe.model
    if model.hub_id is not None:
        if model.is_local:
            if not local:
                raise UsageError(
                    f"model.hub_id {model.hub_id} is a directory on this machine, which a cloud node "
                    "does not have: give a hub id (org/name), or run with --local"
                )
            hub.check_local_model(model.hub_id)
        elif network:
            hub.check_model(model.hub_id, revision=model.revision, gated=model.gated, environ=environ)
    tokenizer = model.tokenizer
    if tokenizer not in (None, "bytes", model.hub_id):
        if hub.is_local_ref(tokenizer):
            if not local:
                raise UsageError(
                    f"model.tokenizer {tokenizer} is a directory on this machine, which a cloud node "
                    "does not have: give a hub id, or run with --local"
                )
            hub.check_local_tokenizer(tokenizer)
        elif network:
            hub.check_model(
                tokenizer, revision=None, gated=model.gated, environ=environ, what="model.tokenizer", need_weights=False
            )
    _check_data(recipe, local=local, environ=environ, network=network)


def _check_data(recipe: Recipe, *, local: bool, environ: Mapping[str, str], network: bool) -> None:
    from skyspot import hub
    from skyspot.storage import is_bucket_uri
    from skyspot.trainer.data import HUB_PREFIX, SYNTHETIC

    data = recipe.data
    source = data.source
    if source == SYNTHETIC:
        return
    if source.startswith(HUB_PREFIX):
        if network:
            name, _, _ = source[len(HUB_PREFIX) :].partition(":")
            hub.check_dataset(name, environ=environ)
        return
    # A bucket file (storage/uri.py decides what is one) is mounted on the node; the trainer checks its
    # records there. A file source's held-out file (data.eval_split) is checked as the source is.
    for key, path in (("data.source", source), ("data.eval_split", data.eval_split)):
        if path and not is_bucket_uri(path):
            _check_file(data, path, key, local=local)
    if (
        data.eval_split
        and not is_bucket_uri(source)
        and not is_bucket_uri(data.eval_split)
        and _same_bytes(source, data.eval_split)
    ):
        raise UsageError(
            f"data.eval_split '{data.eval_split}' is a copy of data.source '{source}': the evaluation "
            "would score the training data; name a held-out file, or use eval.fraction"
        )


def _same_bytes(a: str, b: str) -> bool:
    """Two local files with the same size and sha256 (a held-out file copied from the training one)."""
    import hashlib

    try:
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        digests = []
        for path in (a, b):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            digests.append(h.digest())
        return digests[0] == digests[1]
    except OSError:
        return False


def _check_file(data: DataSection, path: str, key: str, *, local: bool) -> None:
    """A local data file (data.source, or its held-out file): on this machine, and its first record fits
    data.format."""
    from skyspot.trainer.data import check_record, first_record

    if not local:
        raise UsageError(
            f"{key} {path} is a file on this machine, which a cloud node does not have: put it "
            f"in a bucket ({key}=s3://BUCKET/PATH, mounted on the node)"
            + (" or on the hub (hf://ORG/NAME)" if key == "data.source" else "")
        )
    if key != "data.source" and not os.path.isfile(path):
        raise UsageError(f"{key} '{path}' is not an existing file (a second file of data.source's format)")
    where, record = first_record(path, data.split)
    if os.path.splitext(path)[1] in (".jsonl", ".json", ".parquet"):
        check_record(data, record, where)
    elif data.format != "text":
        raise UsageError(
            f"{key} '{path}' is plain text; data.format={data.format} needs records (.jsonl, .json, .parquet or hf://)"
        )
