"""State size: parameter counts and the bytes of the ZeRO state and its checkpoint (skyspot/sizing.py).
Every expected number is worked by hand in a comment (docs/planning.md)."""

from __future__ import annotations

import json

import pytest

from skyspot.errors import UsageError
from skyspot.planning.notice_window import check_notice_windows
from skyspot.recipe import load_recipe
from skyspot.sizing import llama_param_count, state_bytes


def recipe(name: str, *overrides: str):
    return load_recipe(name, list(overrides), environ={})


def test_tiny_parameters_and_checkpoint_bytes_match_a_hand_count():
    # V=260 H=64 I=176 L=2 heads=4 kv=2 -> head_dim 16, untied.
    # embeddings 260*64 = 16,640; per layer: q,o 64*64 = 4,096 each; k,v 64*(2*16) = 2,048 each
    # -> attention 12,288; MLP 3*64*176 = 33,792; norms 2*64 = 128 -> 46,208; x2 layers = 92,416;
    # final norm 64; LM head 16,640. Total 16,640 + 92,416 + 64 + 16,640 = 125,760.
    state = state_bytes(recipe("tiny"), environ={})
    assert state.params == 125_760
    assert state.checkpoint_bytes == 12 * 125_760 == 1_509_120  # fp32 master + m + v
    assert state.bytes_per_node == 1_509_120  # one node
    assert state.bytes_per_rank == 754_560  # two CPU ranks
    assert state.memory_bytes == 16 * 125_760


def test_tied_embeddings_drop_the_lm_head():
    config = dict(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    assert llama_param_count(config) == 125_760 - 260 * 64 == 109_120


def test_llama70b_state_is_847_gb_and_212_gb_per_node():
    # config.json: V=128,256 H=8,192 I=28,672 L=80 heads=64 kv=8 head_dim=128, untied.
    # embeddings 128,256*8,192 = 1,050,673,152 (and the same again for the LM head);
    # per layer: q,o 8,192^2 = 67,108,864 each; k,v 8,192*1,024 = 8,388,608 each -> 150,994,944;
    # MLP 3*8,192*28,672 = 704,643,072; norms 16,384 -> 855,654,400; x80 = 68,452,352,000;
    # total 2*1,050,673,152 + 68,452,352,000 + 8,192 = 70,553,706,496 (the hub's "70.6B").
    state = state_bytes(recipe("llama70b"), environ={})
    assert state.params == 70_553_706_496
    assert state.checkpoint_bytes == 846_644_477_952  # x12 B
    assert state.bytes_per_node == 211_661_119_488  # / 4 nodes
    assert state.bytes_per_rank == 26_457_639_936  # / 32 GPUs
    assert state.memory_bytes_per_rank == 35_276_853_248  # x16 B / 32: 35.3 GB of an 80 GB GPU
    assert "config.json" in state.params_source


def test_llama8b_has_the_hubs_8_03_billion_parameters():
    # embeddings 128,256*4,096 = 525,336,576 (x2 untied); per layer 2*4,096^2 + 2*4,096*1,024 + 3*4,096*14,336
    # + 8,192 = 218,112,000; x32 = 6,979,584,000; + 4,096 -> 8,030,261,248.
    assert state_bytes(recipe("llama8b"), environ={}).params == 8_030_261_248


def test_unknown_hub_model_is_reported_as_unknown_not_an_error():
    unknown = recipe("llama8b", "model.hub_id=acme/secret-model")
    report = check_notice_windows(unknown, environ={})
    assert report.state.params is None and not report.state.known
    assert {c.verdict for c in report.checks} == {"unknown"}
    assert "SKYSPOT_MODEL_PARAMS" in report.advice[0]
    json.dumps(report.to_dict(), allow_nan=False)
    told = state_bytes(unknown, environ={"SKYSPOT_MODEL_PARAMS": "7.2e9"})
    assert told.params == 7_200_000_000 and told.params_source == "SKYSPOT_MODEL_PARAMS"
    with pytest.raises(UsageError, match="SKYSPOT_MODEL_PARAMS"):
        state_bytes(unknown, environ={"SKYSPOT_MODEL_PARAMS": "lots"})


def test_inline_config_without_a_size_field_is_unknown():
    broken = recipe("tiny", "model.config.hidden_size=big")
    state = state_bytes(broken, environ={})
    assert state.params is None and "hidden_size" in state.params_source


def test_lora_checkpoints_only_the_adapters_state():
    """Llama-3.1-70B, r=16 on the 7 linear layers of each of 80 blocks: per block 16 x ((8192+8192) x 2 q,o
    + (8192+1024) x 2 k,v + (8192+28672) x 3 gate,up,down) = 2,588,672; x 80 = 207,093,760 parameters,
    x 12 bytes = 2.49 GB on one node, against 847 GB for the full fine-tune."""
    state = state_bytes(recipe("llama70b-lora"), environ={})
    assert state.params == 207_093_760 and state.checkpoint_bytes == 207_093_760 * 12 == state.bytes_per_node
    assert "LoRA r=16" in state.params_source and "70,553,706,496" in state.params_source
    # resident: the bf16 base (2 B/param) plus 16 B per trainable parameter
    assert state.memory_bytes == 2 * 70_553_706_496 + 16 * 207_093_760
    full = state_bytes(recipe("llama70b"), environ={})
    assert full.checkpoint_bytes / state.checkpoint_bytes > 340


def test_lora_on_a_local_model_counts_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                vocab_size=100,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
    )
    state = state_bytes(
        recipe(
            "llama8b-lora",
            f"model.hub_id={tmp_path}",
            "model.gated=false",
            "train.lora.r=4",
            "train.lora.target_modules=[q_proj,v_proj]",
        ),
        environ={},
    )
    # per block 4 x ((32 + 32) + (32 + 16)) = 448, 2 blocks
    assert state.params == 896 and state.checkpoint_bytes == 896 * 12
    unknown = state_bytes(recipe("llama8b-lora", "train.lora.target_modules=[mixer]"), environ={})
    assert not unknown.known and "cannot count LoRA parameters on mixer" in unknown.params_source
