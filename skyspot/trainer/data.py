"""Training data: sources, formats, tokenising with loss masks, packing or padding, and a
deterministic, resumable sample order.

Sources (recipe `data.source`):
    synthetic            a learnable set made from train.seed: each sample repeats a short random
                         motif of letters, so the loss falls fast and a trained model continues
                         the pattern when it generates
    hf://org/name[:split] a Hugging Face hub dataset, through `datasets.load_dataset`
    path.jsonl           JSON lines, one record (object) per line
    path.json            a JSON array of records (or JSON lines)
    path.parquet         a Parquet file, one record per row
    path.txt             plain text, one document per line (format text only)
    s3://, gs://, az://  such a file in a bucket: the task mounts it and hands the trainer the path
                         there; a trainer given the URI itself downloads it into DIR/data/ first

Held out for evaluation (the eval section; trainer/evaluate.py reads it): data.eval_split, a hub
split or a second file of the same format, built exactly as the training set is (same format, masks,
packing or padding); or eval.fraction of the training set's samples, drawn from train.seed alone
(`hold_out`) and removed before the order below is formed, so no rank ever trains on them.

Formats (recipe `data.format`) turn a record into token ids and labels (-100: no loss):
    text     data.text_field                         [BOS] text [EOS], loss on every token
    alpaca   instruction, input (optional), output    [BOS] prompt output [EOS], the prompt being
                                                      Stanford Alpaca's template; loss on output [EOS]
    chat     data.messages_field: [{role, content}]  the tokenizer's chat template; loss on the
                                                      assistant turns (each as the template renders
                                                      it after the generation prompt), none on the rest

Then either packing (data.packing, the default): the examples are concatenated and cut into
`seq_len` pieces, the remainder dropped; or padding: one example per sequence, truncated to
`seq_len`, padded with the tokenizer's pad token (labels -100), examples left without a single
trained token dropped. Padding goes at the end, so with causal attention no real token attends
to it and no attention mask is needed.

Order: the samples form one stream over epochs. Epoch e is a permutation of the samples drawn
from (seed, e) (or the identity when data.shuffle is off). A step takes the next
`global_batch = micro_batch * grad_accum * data_parallel_size` samples from the stream; rank r's
micro-batch m is the slice [m*dp*mb + r*mb, ... + mb) of that. The whole order is a pure function
of `samples_consumed`, which the checkpoint stores, so a resume continues exactly where it
stopped, and nothing is repeated or skipped; the samples themselves are a pure function of the
data, the tokenizer and the recipe, so every rank and every start builds the same ones.

One concept despite its length: what a sample is (source, format, tokens, loss mask, packed
sequence) and the order the ranks read samples in must change together, or a resume stops being exact.
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
IGNORE_INDEX = -100  # labels that carry no loss (transformers' CrossEntropy ignore_index)
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")

# Stanford Alpaca's prompt (tatsu-lab/stanford_alpaca, train.py PROMPT_DICT), which yahma/alpaca-cleaned
# and most Alpaca-format sets are meant to be trained with.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class Samples:
    """The training set: [num_samples, seq_len] token ids and the labels the loss is taken on."""

    ids: np.ndarray
    labels: np.ndarray
    examples: int = 0
    """Examples (records) the samples were made from; 0 for the synthetic set."""
    dropped: int = 0
    """Examples left out (padding: nothing trainable within seq_len)."""

    def __len__(self) -> int:
        return len(self.ids)


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


def hub_name_and_split(source: str, default_split: str) -> tuple[str, str]:
    """`hf://org/name[:split]` -> ("org/name", split)."""
    name, colon, split = source[len(HUB_PREFIX) :].partition(":")
    return name, (split if colon else default_split)


def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except ValueError as err:
                raise UsageError(f"{path}:{number}: not valid JSON ({err})") from None


def _json_file(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        yield from _json_lines(path)  # JSON lines in a .json file
        return
    if not isinstance(data, list):
        raise UsageError(f"{path}: a .json data file holds a JSON array of records (or JSON lines)")
    for number, record in enumerate(data):
        yield f"{path}[{number}]", record


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow's errors are many
        raise UsageError(f"{path}: not a readable Parquet file ({err})") from None
    row = 0
    for batch in table.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"{path} row {row}", record
            row += 1


def iter_hub_records(
    name: str, split: str, loader: Optional[Callable[..., Any]] = None, **load_kwargs: Any
) -> Iterator[tuple[str, Any]]:
    """Rows of a `datasets` dataset. `hf://org/name` reaches here as name="org/name"; a local file goes
    through the same code as name="json", data_files=PATH (how it is tested)."""
    if loader is None:
        try:
            from datasets import load_dataset as loader
        except ImportError:
            raise UsageError("hub datasets need the `datasets` package (pip install datasets)") from None
    try:
        dataset = loader(name, split=split, **load_kwargs)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"dataset '{name}' (split {split}): {str(err).splitlines()[0][:200]}") from None
    except Exception as err:  # noqa: BLE001
        from skyspot.hub import is_network_error, unreachable

        if is_network_error(err):
            raise unreachable(f"the dataset {name}", os.environ, err) from None
        raise
    for number, row in enumerate(dataset):
        yield f"{name}[{split}] row {number}", row


def iter_records(source: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a source: a hub dataset or a local file (not a bucket URI:
    `resolve_source` brings that here first)."""
    if source.startswith(HUB_PREFIX):
        return iter_hub_records(*hub_name_and_split(source, split))
    if source.startswith(REMOTE_SCHEMES):
        raise UsageError(
            f"data.source '{source}' is in a bucket: the task mounts it on the node (or the trainer "
            "downloads it first); read it through that path"
        )
    path = Path(os.path.expanduser(source))
    if not path.is_file():
        raise UsageError(f"data.source '{source}' is not 'synthetic', hf://org/name, or an existing file")
    if path.suffix == ".jsonl":
        return _json_lines(path)
    if path.suffix == ".json":
        return _json_file(path)
    if path.suffix == ".parquet":
        return _parquet(path)
    return ((f"{path}:{n}", {"text": t}) for n, t in enumerate(iter_text_lines(path), 1))


def iter_text_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\n")


def iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for where, record in _json_lines(path):
        yield _text(record, text_field, where)


def iter_hub(
    name: str, split: str, text_field: str, loader: Optional[Callable[..., Any]] = None, **load_kwargs: Any
) -> Iterator[str]:
    """The `text_field` of each row of a `datasets` dataset."""
    rows = iter_hub_records(name, split, loader, **load_kwargs)
    first = next(rows, None)
    if first is None:
        return
    if not isinstance(first[1], dict) or text_field not in first[1]:
        columns = ", ".join(first[1]) if isinstance(first[1], dict) else "none"
        raise UsageError(f"dataset '{name}' has no column '{text_field}' (columns: {columns}); set data.text_field")
    yield first[1][text_field]
    for _, row in rows:
        yield row[text_field]


def iter_documents(source: str, text_field: str, split: str) -> Iterator[str]:
    """The texts of a source for format text (`.txt` lines are texts whatever text_field says)."""
    records = iter_records(source, split)
    is_txt = not source.startswith(HUB_PREFIX) and Path(source).suffix not in RECORD_SUFFIXES
    return (_text(record, "text" if is_txt else text_field, where) for where, record in records)


def _text(record: Any, field: str, where: str) -> str:
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise UsageError(f"{where}: no string field '{field}' (set data.text_field)")
    return text


def resolve_source(source: str, cache: Path, key: str = "data.source") -> str:
    """A local path for a bucket URI (downloaded into `cache` once, verified by size); other sources
    as they are. Called by node leaders before the ranks read the data; `key` names it in errors."""
    if not source.startswith(REMOTE_SCHEMES):
        return source
    from skyspot.errors import StoreError
    from skyspot.storage import open_store, parse_store_uri

    uri = parse_store_uri(source)
    if not uri.prefix:
        raise UsageError(f"{key} '{source}' names a bucket, not a file in it")
    parent, _, name = uri.prefix.rpartition("/")
    root = f"{uri.scheme}://{uri.account + '/' if uri.account else ''}{uri.bucket}" + (f"/{parent}" if parent else "")
    target = Path(cache) / uri.bucket / uri.prefix
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            open_store(root).get_file(name, target)
        except FileNotFoundError:
            raise UsageError(f"{key} '{source}' does not exist") from None
        except StoreError as err:
            raise UsageError(f"{key} '{source}': {err}") from None
    return str(target)


def local_source_path(source: str, cache: Path) -> str:
    """Where the ranks read a source: a bucket URI's download in `cache`, else the source."""
    if not source.startswith(REMOTE_SCHEMES):
        return source
    from skyspot.storage import parse_store_uri

    uri = parse_store_uri(source)
    return str(Path(cache) / uri.bucket / uri.prefix)


# --------------------------------------------------------------------------- formats


def required_fields(data) -> list[str]:
    """The fields each record must have for the recipe's data.format."""
    if data.format == "alpaca":
        return ["instruction", "output"]
    if data.format == "chat":
        return [data.messages_field]
    return [data.text_field]


def check_record(data, record: Any, where: str) -> None:
    """Raise a UsageError naming what a record lacks for data.format (the first record is checked
    before training: preflight)."""
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    fields = ", ".join(sorted(map(str, record))) or "none"
    if data.format == "text":
        if not isinstance(record.get(data.text_field), str):
            raise UsageError(
                f"{where}: data.format=text needs a string field '{data.text_field}' (fields: {fields}); "
                "set data.text_field"
            )
    elif data.format == "alpaca":
        for name in ("instruction", "output"):
            if not isinstance(record.get(name), str):
                raise UsageError(
                    f"{where}: data.format=alpaca needs string fields instruction and output (and "
                    f"optionally input); this record has: {fields}"
                )
        if record.get("input") is not None and not isinstance(record.get("input"), str):
            raise UsageError(f"{where}: data.format=alpaca: 'input' must be a string")
    else:
        messages = record.get(data.messages_field)
        if not isinstance(messages, list) or not messages:
            raise UsageError(
                f"{where}: data.format=chat needs a list field '{data.messages_field}' of "
                f"{{role, content}} messages (fields: {fields}); set data.messages_field"
            )
        for message in messages:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise UsageError(f"{where}: each message in '{data.messages_field}' needs string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in messages):
            raise UsageError(f"{where}: a conversation without an assistant turn has nothing to learn")


def _encode(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "encode_document"):  # the byte tokenizer
        return tokenizer.encode(text, add_bos=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_document"):
        return [tokenizer.encode(t, add_bos=False) for t in texts]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _bos(tokenizer) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None else []


def _eos(tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if eos is not None else []


def encode_document(tokenizer, text: str) -> list[int]:
    """[BOS] text [EOS] as token ids, for the byte tokenizer and Hugging Face tokenizers alike."""
    if hasattr(tokenizer, "encode_document"):
        return tokenizer.encode_document(text)
    return _bos(tokenizer) + _encode(tokenizer, text) + _eos(tokenizer)


def alpaca_prompt(record: dict) -> str:
    context = (record.get("input") or "").strip()
    if context:
        return ALPACA_PROMPT.format(instruction=record["instruction"], input=context)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=record["instruction"])


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_example(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """ids and labels of a conversation: each assistant turn is trained on, as the template renders it
    after the generation prompt; everything else is context. Messages after the last assistant turn
    teach nothing and are left out."""
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _chat_ids(tokenizer, messages[:i], generation_prompt=True)
        full = _chat_ids(tokenizer, messages[: i + 1], generation_prompt=False)
        if prompt[: len(ids)] != ids or full[: len(prompt)] != prompt:
            raise UsageError(
                f"{where}: the chat template does not render a conversation as a prefix of its "
                "continuation, so the assistant turns cannot be told apart; use data.format=text"
            )
        context, turn = prompt[len(ids) :], full[len(prompt) :]
        ids += context + turn
        labels += [IGNORE_INDEX] * len(context) + turn
    return ids, labels


def examples(
    recipe, tokenizer, records: Iterable[tuple[str, Any]], chunk: int = 1024
) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, labels) per record, for the recipe's data.format. Tokenised in chunks (fast tokenizers
    encode a list in parallel)."""
    data = recipe.data
    if data.format == "chat" and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or recipe.model.tokenizer or recipe.model.hub_id
        raise UsageError(
            f"data.format=chat needs a tokenizer with a chat template; {name} has none "
            "(use data.format=alpaca or text, or a tokenizer that has one)"
        )
    batch: list[tuple[str, Any]] = []

    def flush() -> Iterator[tuple[list[int], list[int]]]:
        for where, record in batch:
            check_record(data, record, where)
        if data.format == "text":
            for ids in _encode_many(tokenizer, [r[data.text_field] for _, r in batch]):
                ids = _bos(tokenizer) + ids + _eos(tokenizer)
                yield ids, ids
        elif data.format == "alpaca":
            prompts = _encode_many(tokenizer, [alpaca_prompt(r) for _, r in batch])
            outputs = _encode_many(tokenizer, [r["output"] for _, r in batch])
            for prompt, output in zip(prompts, outputs):
                prompt = _bos(tokenizer) + prompt
                output = output + _eos(tokenizer)
                yield prompt + output, [IGNORE_INDEX] * len(prompt) + output
        else:
            for where, record in batch:
                yield chat_example(tokenizer, record[data.messages_field], where)
        batch.clear()

    for item in records:
        batch.append(item)
        if len(batch) >= chunk:
            yield from flush()
    yield from flush()


# --------------------------------------------------------------------------- packing and padding


def pack(documents: Iterable[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate token ids and cut them into [n, seq_len] (the remainder is dropped)."""
    return pack_examples(((ids, ids) for ids in documents), seq_len).ids


def pack_examples(items: Iterable[tuple[list[int], list[int]]], seq_len: int) -> Samples:
    """Concatenate (ids, labels) and cut both into [n, seq_len] (the remainder is dropped)."""
    chunks: list[np.ndarray] = []
    label_chunks: list[np.ndarray] = []
    ids_buf: list[int] = []
    labels_buf: list[int] = []
    count = 0

    def cut() -> None:
        nonlocal ids_buf, labels_buf
        whole = len(ids_buf) // seq_len * seq_len
        if whole:
            chunks.append(np.asarray(ids_buf[:whole], dtype=np.int64).reshape(-1, seq_len))
            label_chunks.append(np.asarray(labels_buf[:whole], dtype=np.int64).reshape(-1, seq_len))
            ids_buf, labels_buf = ids_buf[whole:], labels_buf[whole:]

    for ids, labels in items:
        ids_buf.extend(ids)
        labels_buf.extend(labels)
        count += 1
        if len(ids_buf) >= 64 * seq_len:
            cut()
    cut()
    if not chunks:
        empty = np.empty((0, seq_len), dtype=np.int64)
        return Samples(empty, empty.copy(), count)
    return Samples(np.concatenate(chunks), np.concatenate(label_chunks), count)


def pad_examples(items: Iterable[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Samples:
    """One example per row, truncated to seq_len, padded with pad_id (labels IGNORE_INDEX); examples
    with nothing to train on within seq_len are dropped."""
    rows: list[list[int]] = []
    label_rows: list[list[int]] = []
    count = dropped = 0
    for ids, labels in items:
        count += 1
        ids, labels = ids[:seq_len], labels[:seq_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):  # position 0 is never predicted
            dropped += 1
            continue
        padding = seq_len - len(ids)
        rows.append(ids + [pad_id] * padding)
        label_rows.append(labels + [IGNORE_INDEX] * padding)
    ids_array = np.asarray(rows, dtype=np.int64).reshape(-1, seq_len)
    return Samples(ids_array, np.asarray(label_rows, dtype=np.int64).reshape(-1, seq_len), count, dropped)


def pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def build_dataset(recipe, tokenizer, source: Optional[str] = None) -> Samples:
    """The recipe's data set, held-out part included: token ids and labels, [num_samples, seq_len]
    each. `source` is where to read data.source from (a bucket file's local copy); default
    data.source itself. `training_and_held_out` splits it."""
    data, train = recipe.data, recipe.train
    if data.source == SYNTHETIC:
        ids = synthetic_samples(data.num_samples, train.seq_len, train.seed, tokenizer.bos_token_id)
        return Samples(ids, ids)
    return _samples_from(recipe, tokenizer, source or data.source, data.split, f"data.source '{data.source}'")


def _samples_from(recipe, tokenizer, path: str, split: str, label: str) -> Samples:
    """Samples of one source (a local file or hub dataset), tokenised, masked and packed or padded as
    the recipe says: the training set and an eval_split set go through exactly the same steps.
    `label` names the source in errors (`data.source 'x.jsonl'`)."""
    data, train = recipe.data, recipe.train
    records = iter_records(path, split)
    is_txt = not path.startswith(HUB_PREFIX) and Path(path).suffix not in RECORD_SUFFIXES
    if is_txt and data.format != "text":
        raise UsageError(
            f"{label} is plain text; data.format={data.format} needs records (.jsonl, .json, .parquet or hf://)"
        )
    if is_txt:
        records = ((where, {data.text_field: r["text"]}) for where, r in records)
    items = examples(recipe, tokenizer, records)
    samples = (
        pack_examples(items, train.seq_len) if data.packing else pad_examples(items, train.seq_len, pad_id(tokenizer))
    )
    if len(samples) == 0:
        if data.packing:
            raise UsageError(f"{label} holds fewer than seq_len={train.seq_len} tokens")
        raise UsageError(f"{label}: no example has anything to train on within seq_len={train.seq_len}")
    return samples


def build_eval_split(recipe, tokenizer, source: Optional[str] = None) -> Samples:
    """The data.eval_split set: the hub dataset's split of that name, or the second file (`source`:
    a bucket file's local copy), read, masked and packed or padded as the training set is."""
    data = recipe.data
    label = f"data.eval_split '{data.eval_split}'"
    if data.source.startswith(HUB_PREFIX):
        name, _ = hub_name_and_split(data.source, data.split)
        return _samples_from(recipe, tokenizer, HUB_PREFIX + name, data.eval_split, label)
    path = source or data.eval_split
    if not Path(os.path.expanduser(path)).is_file():
        raise UsageError(f"{label} is not an existing file (a second file of data.source's format)")
    return _samples_from(recipe, tokenizer, path, data.split, label)


def hold_out(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, held-out indices) for eval.fraction: a pure function of the set's size, the
    fraction and train.seed, so every rank, every start and every world size holds out the same
    samples. At least one sample on each side; training keeps its samples in their original order."""
    if num_samples < 2:
        raise UsageError(f"eval.fraction needs at least 2 samples to hold some out; the data set has {num_samples}")
    count = min(num_samples - 1, max(1, round(fraction * num_samples)))
    held = np.random.default_rng([seed, 0xE7A1]).permutation(num_samples)[:count]
    mask = np.ones(num_samples, dtype=bool)
    mask[held] = False
    return np.flatnonzero(mask), np.sort(held)


def subset(samples: Samples, indices: np.ndarray) -> Samples:
    return Samples(samples.ids[indices], samples.labels[indices], samples.examples, samples.dropped)


def training_and_held_out(
    recipe, samples: Samples, eval_split: Optional[Samples] = None
) -> tuple[Samples, Optional[Samples]]:
    """The training set and the held-out set the eval section names: data.eval_split's own set
    (built by build_eval_split), or eval.fraction of `samples`, removed from training (so the
    training order, DataOrder, never reaches them); no held-out set without either."""
    if eval_split is not None:
        return samples, eval_split
    fraction = recipe.eval.fraction
    if fraction is None:
        return samples, None
    train_idx, held_idx = hold_out(len(samples), fraction, recipe.train.seed)
    return subset(samples, train_idx), subset(samples, held_idx)


def build_samples(recipe, tokenizer) -> np.ndarray:
    """The recipe's training set as [num_samples, seq_len] token ids (labels: build_dataset)."""
    return build_dataset(recipe, tokenizer).ids


def first_record(source: str, split: str = "train") -> tuple[str, Any]:
    """The first record of a local source (preflight); raises UsageError when there is none."""
    for item in iter_records(source, split):
        return item
    raise UsageError(f"data.source '{source}' holds no records")


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
            out.append(self.permutation(epoch)[position : position + take])
            consumed += take
            count -= take
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def step_indices(self, consumed: int) -> np.ndarray:
        """This rank's [grad_accum, micro_batch] sample indices for the step starting at `consumed`."""
        batch = self.global_indices(consumed, self.global_batch).reshape(
            self.grad_accum, self.dp_size, self.micro_batch
        )
        return batch[:, self.dp_rank, :]

    def state(self, consumed: int) -> dict[str, Any]:
        """What the checkpoint records (consumed is the truth; epoch and position are for readers)."""
        epoch, position = divmod(consumed, self.num_samples)
        return {
            "samples_consumed": consumed,
            "epoch": epoch,
            "position": position,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch": self.global_batch,
        }


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
        return (
            micro_batch,
            grad_accum,
            (
                f"the checkpoint's global batch {global_batch} does not divide by {dp_size} ranks: continuing with "
                f"{micro_batch * grad_accum * dp_size} samples per step (the data stream continues where it stopped)"
            ),
        )
    share = global_batch // dp_size
    micro = max(d for d in range(1, min(micro_batch, share) + 1) if share % d == 0)
    return (
        micro,
        share // micro,
        (
            f"keeping the global batch of {global_batch} samples on {dp_size} rank{'s' if dp_size != 1 else ''}: micro batch {micro} x "
            f"{share // micro} accumulation steps"
        ),
    )
