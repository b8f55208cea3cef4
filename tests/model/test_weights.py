"""Checkpoint loading: the packaged model, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusedserve.model.config import EncoderConfig
from fusedserve.model.families import config_from_dir
from fusedserve.model.weights import CheckpointError, convert_state_dict, default_model_dir, load_encoder


@pytest.fixture(scope="module")
def minilm_tensors():
    return load_file(default_model_dir() / "model.safetensors")


@pytest.fixture
def model_copy(tmp_path):
    """A writable copy of the packaged model's small files (weights are written by each test)."""
    for name in ("config.json", "sentence_bert_config.json", "modules.json", "tokenizer.json"):
        shutil.copy(default_model_dir() / name, tmp_path / name)
    return tmp_path


def test_default_config_matches_minilm():
    config = config_from_dir(default_model_dir())
    assert config == EncoderConfig.from_name("minilm-l6")
    assert config.max_seq_length == 256 and config.normalize


def test_qkv_is_stacked_in_query_key_value_order(minilm_tensors):
    state, _ = convert_state_dict(dict(minilm_tensors), EncoderConfig.from_name("minilm-l6"))
    qkv = state["layers.3.qkv.weight"]
    assert qkv.shape == (3 * 384, 384)
    assert torch.equal(qkv[384:768], minilm_tensors["encoder.layer.3.attention.self.key.weight"])


def test_hf_prefixes_are_accepted(minilm_tensors, model_copy):
    save_file({f"bert.{k}": v for k, v in minilm_tensors.items()}, model_copy / "model.safetensors")
    encoder = load_encoder(model_copy)
    torch.testing.assert_close(encoder.embeddings.ln_weight, minilm_tensors["embeddings.LayerNorm.weight"])


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        load_encoder("/nonexistent/model")


def test_missing_weights_file(model_copy):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_encoder(model_copy)


def test_corrupt_weights_file(model_copy):
    data = (default_model_dir() / "model.safetensors").read_bytes()
    (model_copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_encoder(model_copy)


def test_garbage_weights_file(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 10)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_encoder(model_copy)


def test_shape_mismatch_is_named(minilm_tensors, model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["intermediate_size"] = 1024
    (model_copy / "config.json").write_text(json.dumps(config))
    save_file(dict(minilm_tensors), model_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"ffn_in.weight: checkpoint \(1536, 384\) vs config \(1024, 384\)"):
        load_encoder(model_copy)


def test_missing_tensor_is_named(minilm_tensors, model_copy):
    tensors = {k: v for k, v in minilm_tensors.items() if "layer.5.output.dense" not in k}
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 2 tensors.*encoder.layer.5.output.dense"):
        load_encoder(model_copy)


def test_extra_layers_are_an_error(minilm_tensors, model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (model_copy / "config.json").write_text(json.dumps(config))
    save_file(dict(minilm_tensors), model_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not use.*num_layers=4"):
        load_encoder(model_copy)


def test_unsupported_activation(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["hidden_act"] = "relu"
    (model_copy / "config.json").write_text(json.dumps(config))
    shutil.copy(default_model_dir() / "model.safetensors", model_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="hidden_act 'relu'"):
        load_encoder(model_copy)
