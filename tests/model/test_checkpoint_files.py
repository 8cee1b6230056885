"""Checkpoint files are data from strangers: an index may only name files inside the checkpoint directory, and a
broken file gives one line naming it (and the JSON position), not a library traceback."""

import json
import os

import pytest
import torch

from exactrl.model.config import preset
from exactrl.model.files import CheckpointError
from exactrl.model.hf import load_model, save_model
from exactrl.model.qwen import build_model
from exactrl.model.tokenizer import Tokenizer, byte_tokenizer


@pytest.fixture
def sharded(tmp_path):
    """A two-shard checkpoint of a 1-layer tiny model with an index."""
    model = build_model(preset("tiny", num_layers=1, vocab_size=300), seed=0)
    save_model(model, tmp_path / "ckpt", tokenizer=byte_tokenizer(), max_shard_bytes=200_000)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    assert index.is_file()
    return tmp_path / "ckpt", model


def _rewrite_index(ckpt, fname_for):
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = sorted(set(doc["weight_map"].values()))[0]
    doc["weight_map"] = {n: (fname_for(f) if f == first else f) for n, f in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    return first


def test_sharded_checkpoint_loads(sharded):
    ckpt, model = sharded
    back = load_model(ckpt)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in model.state_dict().items())


def test_index_naming_a_file_outside_is_refused(sharded, tmp_path):
    ckpt, _ = sharded
    outside = tmp_path / "outside"
    outside.mkdir()
    first = _rewrite_index(ckpt, lambda f: f"../outside/{f}")
    (ckpt / first).rename(outside / first)  # the file exists there: only the location is wrong
    with pytest.raises(
        CheckpointError, match=r"weight_map file '\.\./outside/.*' resolves outside the checkpoint"
    ):
        load_model(ckpt)


def test_index_naming_an_absolute_path_is_refused(sharded):
    ckpt, _ = sharded
    first = sorted(p.name for p in ckpt.glob("*.safetensors"))[0]
    absolute = str((ckpt / first).resolve())
    _rewrite_index(ckpt, lambda f: absolute)
    with pytest.raises(CheckpointError, match="weight_map names an absolute path"):
        load_model(ckpt)


def test_symlink_out_of_the_directory_is_refused(sharded, tmp_path):
    ckpt, _ = sharded
    first = sorted(p.name for p in ckpt.glob("*.safetensors"))[0]
    elsewhere = tmp_path / "elsewhere.safetensors"
    (ckpt / first).rename(elsewhere)
    os.symlink(elsewhere, ckpt / first)  # the index names a plain file name; the link leads out
    with pytest.raises(CheckpointError, match="resolves outside the checkpoint directory"):
        load_model(ckpt)


def test_truncated_safetensors_names_the_file(sharded):
    ckpt, _ = sharded
    f = sorted(ckpt.glob("*.safetensors"))[-1]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ") and "\n" not in msg, msg


def test_garbage_safetensors_names_the_file(tmp_path):
    model = build_model(preset("tiny", num_layers=1, vocab_size=300), seed=0)
    save_model(model, tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert str(e.value).startswith(f"{f}: not a readable safetensors file") and "\n" not in str(e.value)


def test_broken_config_json_names_file_and_position(tmp_path):
    model = build_model(preset("tiny", num_layers=1, vocab_size=300), seed=0)
    save_model(model, tmp_path)
    (tmp_path / "config.json").write_text('{\n  "vocab_size": 300,\n  "hidden_size": 128,,\n}\n')
    with pytest.raises(CheckpointError, match=r"config\.json:3:22: invalid JSON"):
        load_model(tmp_path)


def test_broken_tokenizer_config_json_names_file_and_position(tmp_path):
    byte_tokenizer().save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>" "pad_token": 1}')
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json:1:31: invalid JSON: Expecting ','"):
        Tokenizer.load(tmp_path)


def test_broken_tokenizer_json_names_the_file(tmp_path):
    byte_tokenizer().save(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(CheckpointError) as e:
        Tokenizer.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'tokenizer.json'}: not a readable tokenizer.json")


def test_index_tensor_missing_from_its_shard_is_named(sharded):
    ckpt, _ = sharded
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name = "model.norm.weight"
    wrong = next(f for f in set(doc["weight_map"].values()) if f != doc["weight_map"][name])
    doc["weight_map"][name] = wrong
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=f"{wrong}: has no tensor {name}"):
        load_model(ckpt)
