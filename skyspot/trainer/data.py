"""Training data: sources, tokenising and packing, and a deterministic, resumable sample order.

Sources (recipe `data.source`):
    synthetic          a learnable set made from train.seed: each sample repeats a short random
                       motif of letters, so the loss falls fast and a trained model continues
                       the pattern when it generates
    hf://org/name      a Hugging Face hub dataset, through `datasets.load_dataset`
    path.jsonl         JSON lines, the text in `data.text_field`
    path.txt           plain text, one document per line
    s3://, gs://, az:// a file in a bucket (not yet: needs the store tier)

Every text source goes through one path: documents -> token ids ([BOS] text [EOS]) ->
concatenated and cut into `seq_len` pieces (packing; the remainder is dropped).

Order: the samples form one stream over epochs. Epoch e is a permutation of the samples drawn
from (seed, e) (or the identity when data.shuffle is off). A step takes the next
`global_batch = micro_batch * grad_accum * data_parallel_size` samples from the stream; rank r's
micro-batch m is the slice [m*dp*mb + r*mb, ... + mb) of that. The whole order is a pure function
of `samples_consumed`, which the checkpoint stores, so a resume continues exactly where it
stopped, and nothing is repeated or skipped.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from skyspot.errors import UsageError

SYNTHETIC = "synthetic"
HUB_PREFIX = "hf://"
REMOTE_SCHEMES = ("s3://", "gs://", "az://")


# --------------------------------------------------------------------------- sources


def synthetic_samples(num_samples: int, seq_len: int, seed: int, bos_id: int) -> np.ndarray:
    """[num_samples, seq_len] token ids: BOS, then a motif of 2-8 lowercase letters repeated."""
    rng = np.random.default_rng([seed, 0x5EED])
    out = np.empty((num_samples, seq_len), dtype=np.int64)
    for i in range(num_samples):
        length = int(rng.integers(2, 9))
        motif = rng.integers(ord("a"), ord("z") + 1, size=length)
        reps = -(-(seq_len - 1) // length)
        out[i, 0] = bos_id
        out[i, 1:] = np.tile(motif, reps)[: seq_len - 1]
    return out


def iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise UsageError(f"{path}:{number}: not valid JSON ({err})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UsageError(f"{path}:{number}: no string field '{text_field}' (set data.text_field)")
            yield text


def iter_text_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\n")


def iter_hub(name: str, split: str, text_field: str, loader: Optional[Callable[..., Any]] = None,
             **load_kwargs: Any) -> Iterator[str]:
    """Rows of a `datasets` dataset. `hf://org/name` reaches here as name="org/name"; a local
    JSONL file goes through the same code as name="json", data_files=PATH (how it is tested)."""
    if loader is None:
        try:
            from datasets import load_dataset as loader
        except ImportError:
            raise UsageError("hub datasets need the `datasets` package (pip install datasets)") from None
    dataset = loader(name, split=split, **load_kwargs)
    if text_field not in dataset.column_names:
        raise UsageError(f"dataset '{name}' has no column '{text_field}' "
                         f"(columns: {', '.join(dataset.column_names)}); set data.text_field")
    for row in dataset:
        yield row[text_field]


def iter_documents(source: str, text_field: str, split: str) -> Iterator[str]:
    if source.startswith(HUB_PREFIX):
        return iter_hub(source[len(HUB_PREFIX):], split, text_field)
    if source.startswith(REMOTE_SCHEMES):
        raise UsageError(f"data.source '{source}': reading data from a bucket is not supported yet; "
                         "copy the file to the node (a SkyPilot file mount) and give its path")
    path = Path(os.path.expanduser(source))
    if not path.is_file():
        raise UsageError(f"data.source '{source}' is not 'synthetic', hf://org/name, or an existing file")
    if path.suffix in (".jsonl", ".json"):
        return iter_jsonl(path, text_field)
    return iter_text_lines(path)


# --------------------------------------------------------------------------- tokenise and pack


def encode_document(tokenizer, text: str) -> list[int]:
    """[BOS] text [EOS] as token ids, for the byte tokenizer and Hugging Face tokenizers alike."""
    if hasattr(tokenizer, "encode_document"):
        return tokenizer.encode_document(text)
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def pack(documents: Iterable[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate token ids and cut them into [n, seq_len] (the remainder is dropped)."""
    chunks: list[np.ndarray] = []
    buffer: list[int] = []
    for ids in documents:
        buffer.extend(ids)
        if len(buffer) >= 64 * seq_len:
            whole = len(buffer) // seq_len * seq_len
            chunks.append(np.asarray(buffer[:whole], dtype=np.int64).reshape(-1, seq_len))
            buffer = buffer[whole:]
    whole = len(buffer) // seq_len * seq_len
    if whole:
        chunks.append(np.asarray(buffer[:whole], dtype=np.int64).reshape(-1, seq_len))
    if not chunks:
        return np.empty((0, seq_len), dtype=np.int64)
    return np.concatenate(chunks)


def build_samples(recipe, tokenizer) -> np.ndarray:
    """The recipe's training set as [num_samples, seq_len] token ids."""
    data, train = recipe.data, recipe.train
    if data.source == SYNTHETIC:
        return synthetic_samples(data.num_samples, train.seq_len, train.seed, tokenizer.bos_token_id)
    texts = iter_documents(data.source, data.text_field, data.split)
    samples = pack((encode_document(tokenizer, t) for t in texts), train.seq_len)
    if len(samples) == 0:
        raise UsageError(f"data.source '{data.source}' holds fewer than seq_len={train.seq_len} tokens")
    return samples


# --------------------------------------------------------------------------- order


@dataclass(frozen=True)
class DataOrder:
    """Which samples each rank trains on at each step: a pure function of samples consumed."""

    num_samples: int
    seed: int
    shuffle: bool
    dp_rank: int
    dp_size: int
    micro_batch: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    @functools.lru_cache(maxsize=2)  # the current epoch and the next (a batch may straddle them)
    def permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, 0xDA7A, epoch]).permutation(self.num_samples)

    def global_indices(self, consumed: int, count: int) -> np.ndarray:
        """Sample indices at stream positions [consumed, consumed + count)."""
        out = []
        while count > 0:
            epoch, position = divmod(consumed, self.num_samples)
            take = min(count, self.num_samples - position)
            out.append(self.permutation(epoch)[position:position + take])
            consumed += take
            count -= take
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def step_indices(self, consumed: int) -> np.ndarray:
        """This rank's [grad_accum, micro_batch] sample indices for the step starting at `consumed`."""
        batch = self.global_indices(consumed, self.global_batch).reshape(self.grad_accum, self.dp_size, self.micro_batch)
        return batch[:, self.dp_rank, :]

    def state(self, consumed: int) -> dict[str, Any]:
        """What the checkpoint records (consumed is the truth; epoch and position are for readers)."""
        epoch, position = divmod(consumed, self.num_samples)
        return {"samples_consumed": consumed, "epoch": epoch, "position": position,
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch": self.global_batch}


def rebatch(global_batch: int, micro_batch: int, grad_accum: int, dp_size: int) -> tuple[int, int, Optional[str]]:
    """(micro_batch, grad_accum, note) for `dp_size` ranks that keep a checkpoint's `global_batch`.

    Resuming at another world size keeps the samples per step, so the stream position, the
    learning-rate schedule and the samples of every step stay what they were: each rank's share
    is split into the largest micro batch not above the recipe's, times accumulation steps. When
    the global batch does not divide by the new number of ranks, the recipe's split is kept and
    the global batch changes (the note says so); the stream still continues where it stopped.
    """
    if micro_batch * grad_accum * dp_size == global_batch:
        return micro_batch, grad_accum, None
    if global_batch % dp_size:
        return micro_batch, grad_accum, (
            f"the checkpoint's global batch {global_batch} does not divide by {dp_size} ranks: continuing with "
            f"{micro_batch * grad_accum * dp_size} samples per step (the data stream continues where it stopped)")
    share = global_batch // dp_size
    micro = max(d for d in range(1, min(micro_batch, share) + 1) if share % d == 0)
    return micro, share // micro, (
        f"keeping the global batch of {global_batch} samples on {dp_size} rank{'s' if dp_size != 1 else ''}: micro batch {micro} x "
        f"{share // micro} accumulation steps")
