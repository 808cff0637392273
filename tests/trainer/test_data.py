"""Data: sources, packing, and an order that resumes exactly (no torchrun)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skyspot.errors import UsageError
from skyspot.trainer.data import DataOrder, encode_document, iter_documents, iter_hub, pack, synthetic_samples
from skyspot.trainer.model import ByteTokenizer


def order(dp_rank=0, dp_size=2, n=10, shuffle=True, mb=2, accum=2):
    return DataOrder(
        num_samples=n, seed=7, shuffle=shuffle, dp_rank=dp_rank, dp_size=dp_size, micro_batch=mb, grad_accum=accum
    )


def test_order_is_a_pure_function_of_samples_consumed():
    a, b = order(), order()
    assert all(np.array_equal(a.step_indices(c), b.step_indices(c)) for c in range(0, 80, 8))


def test_ranks_split_each_global_batch_without_overlap():
    consumed = 16
    parts = [order(dp_rank=r, n=100).step_indices(consumed).ravel() for r in range(2)]
    together = np.concatenate(parts)
    assert len(set(together.tolist())) == len(together) == order().global_batch
    assert sorted(together.tolist()) == sorted(order(n=100).global_indices(consumed, 8).tolist())


def test_each_epoch_visits_every_sample_once_and_epochs_differ():
    o = order(n=12)
    stream = o.global_indices(0, 36)
    for e in range(3):
        assert sorted(stream[12 * e : 12 * (e + 1)].tolist()) == list(range(12))
    assert stream[:12].tolist() != stream[12:24].tolist()
    assert order(n=12, shuffle=False).global_indices(0, 12).tolist() == list(range(12))


def test_resumed_order_continues_the_uninterrupted_one():
    o = order(n=10)  # global batch 8 does not divide 10: batches straddle epochs
    uninterrupted = [o.step_indices(8 * s) for s in range(12)]
    state = o.state(8 * 5)
    resumed = order(n=10)
    again = [resumed.step_indices(state["samples_consumed"] + 8 * s) for s in range(7)]
    assert all(np.array_equal(x, y) for x, y in zip(uninterrupted[5:], again))
    assert state["epoch"] == 4 and state["position"] == 0


def test_synthetic_set_is_deterministic_and_learnable():
    a = synthetic_samples(64, 32, seed=1, bos_id=256)
    assert np.array_equal(a, synthetic_samples(64, 32, seed=1, bos_id=256))
    assert not np.array_equal(a, synthetic_samples(64, 32, seed=2, bos_id=256))
    assert (a[:, 0] == 256).all() and ((a[:, 1:] >= ord("a")) & (a[:, 1:] <= ord("z"))).all()
    row = a[0, 1:]
    period = next(p for p in range(2, 9) if np.array_equal(row[p:], row[:-p]))
    assert period <= 8


def test_packing_concatenates_documents_and_drops_the_remainder():
    packed = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4)
    assert packed.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_byte_tokenizer_round_trips_text():
    tok = ByteTokenizer()
    ids = tok.encode_document("héllo")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "héllo"


def _jsonl(tmp_path, texts):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_hub_path_and_local_jsonl_give_the_same_samples(tmp_path):
    pytest.importorskip("datasets")
    texts = [f"document {i}: " + "abc" * i for i in range(40)]
    path = _jsonl(tmp_path, texts)
    tok = ByteTokenizer()
    local = pack((encode_document(tok, t) for t in iter_documents(str(path), "text", "train")), 16)
    # The hub loader (`hf://org/name`) through datasets.load_dataset, on the same file.
    hub = pack((encode_document(tok, t) for t in iter_hub("json", "train", "text", data_files=str(path))), 16)
    assert local.shape[1] == 16 and len(local) > 10
    assert np.array_equal(local, hub)


def test_bad_data_sources_say_what_to_do(tmp_path):
    with pytest.raises(UsageError, match="not 'synthetic'"):
        list(iter_documents(str(tmp_path / "missing.jsonl"), "text", "train"))
    with pytest.raises(UsageError, match="data.text_field"):
        list(iter_documents(str(_jsonl(tmp_path, ["x"])), "body", "train"))
    with pytest.raises(UsageError, match="bucket"):
        iter_documents("s3://bucket/data.jsonl", "text", "train")


# --------------------------------------------------------------------------- formats, masks, sources


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A real byte-level BPE tokenizer with a chat template (tests/trainer/real_model.py)."""
    from tests.trainer.real_model import alpaca_records, build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), [" ".join(r.values()) for r in alpaca_records()])


def _recipe(tmp_path, source, *overrides):
    from skyspot.recipe import load_recipe
    from tests.trainer.real_model import recipe_file

    return load_recipe(str(recipe_file(tmp_path / "r.yaml", tmp_path, source)), list(overrides), environ={})


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_alpaca_trains_on_the_output_only(tmp_path, bpe):
    from skyspot.trainer.data import ALPACA_PROMPT, IGNORE_INDEX, examples

    record = {"instruction": "Reverse the words.", "input": "apple river", "output": "river apple"}
    recipe = _recipe(tmp_path, _write(tmp_path / "a.jsonl", [record]))
    [(ids, labels)] = list(examples(recipe, bpe, [("a:1", record)]))
    prompt = [bpe.bos_token_id] + bpe(
        ALPACA_PROMPT.format(instruction=record["instruction"], input="apple river"), add_special_tokens=False
    )["input_ids"]
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    trained = labels[len(prompt) :]
    assert trained == ids[len(prompt) :] and trained[-1] == bpe.eos_token_id
    assert bpe.decode(trained[:-1]) == "river apple"
    # without an input, the other Alpaca prompt
    [(ids, _)] = list(examples(recipe, bpe, [("a:2", {**record, "input": ""})]))
    assert "### Input:" not in bpe.decode(ids) and "### Response:\nriver apple" in bpe.decode(ids)


def test_chat_trains_on_every_assistant_turn_and_nothing_else(tmp_path, bpe):
    from skyspot.trainer.data import IGNORE_INDEX, examples
    from tests.trainer.real_model import chat_records

    record = chat_records(1)[0]
    recipe = _recipe(tmp_path, _write(tmp_path / "c.jsonl", [record]), "data.format=chat")
    [(ids, labels)] = list(examples(recipe, bpe, [("c:1", record)]))
    assert ids == bpe.apply_chat_template(record["messages"], tokenize=True)
    trained = bpe.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])
    assert trained == (f"{record['messages'][2]['content']}<|im_end|>\nYou are welcome.<|im_end|>\n")


def test_padding_keeps_one_example_per_sequence_and_drops_what_cannot_be_trained(tmp_path, bpe):
    from skyspot.trainer.data import IGNORE_INDEX, build_dataset

    records = [
        {"instruction": "Say yes.", "input": "", "output": "yes"},
        {"instruction": "word " * 200, "input": "", "output": "no"},
    ]  # the prompt alone passes seq_len
    recipe = _recipe(tmp_path, _write(tmp_path / "a.jsonl", records), "data.packing=false")
    samples = build_dataset(recipe, bpe)
    assert (len(samples), samples.examples, samples.dropped) == (1, 2, 1)
    row, labels = samples.ids[0], samples.labels[0]
    real = int((row != bpe.pad_token_id).sum())
    assert (row[real:] == bpe.pad_token_id).all() and (labels[real:] == IGNORE_INDEX).all()
    packed = build_dataset(_recipe(tmp_path, recipe.data.source), bpe)
    assert packed.ids.shape[1] == 128 and (packed.labels != IGNORE_INDEX).sum() > 0


def test_jsonl_json_and_parquet_give_the_same_samples(tmp_path, bpe):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from skyspot.trainer.data import build_dataset
    from tests.trainer.real_model import alpaca_records

    records = alpaca_records(24)
    jsonl = _write(tmp_path / "d.jsonl", records)
    (tmp_path / "d.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    built = [
        build_dataset(_recipe(tmp_path, path), bpe) for path in (jsonl, tmp_path / "d.json", tmp_path / "d.parquet")
    ]
    for other in built[1:]:
        assert np.array_equal(built[0].ids, other.ids) and np.array_equal(built[0].labels, other.labels)
    hub = build_dataset(_recipe(tmp_path, jsonl), bpe, source=str(jsonl))
    assert np.array_equal(hub.ids, built[0].ids)


def test_a_bucket_file_is_downloaded_once_then_read_locally(tmp_path, s3_server):
    import boto3

    from skyspot.trainer.data import local_source_path, resolve_source

    bucket = s3_server.bucket()
    boto3.client("s3", endpoint_url=s3_server.url).put_object(Bucket=bucket[5:], Key="sets/a.jsonl", Body=b"{}\n")
    cache = tmp_path / "data"
    assert resolve_source(f"{bucket}/sets/a.jsonl", cache) == local_source_path(f"{bucket}/sets/a.jsonl", cache)
    assert (cache / bucket[5:] / "sets" / "a.jsonl").read_bytes() == b"{}\n"
    with pytest.raises(UsageError, match="does not exist"):
        resolve_source(f"{bucket}/sets/missing.jsonl", cache)
