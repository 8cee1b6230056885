"""`write_policy`: a checkpoint's policy/ written, or hard-linked from an earlier one of the same frozen weights."""

import torch
from safetensors.torch import load_file

from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.train.checkpoint import write_policy


def test_policy_files_are_linked_from_a_frozen_earlier_copy_else_written(tmp_path):
    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    tok = byte_tokenizer()
    assert write_policy(model, tmp_path / "a", tok) is False
    assert write_policy(model, tmp_path / "b", tok, frozen_from=tmp_path / "a") is True
    names = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert "model.safetensors" in names and names == sorted(f.name for f in (tmp_path / "b").iterdir())
    for n in names:
        assert (tmp_path / "b" / n).stat().st_ino == (tmp_path / "a" / n).stat().st_ino
    # Without an earlier copy (or with one that is gone) the files are written, with the model's weights.
    assert write_policy(model, tmp_path / "c", tok, frozen_from=tmp_path / "gone") is False
    c = tmp_path / "c" / "model.safetensors"
    assert c.stat().st_ino != (tmp_path / "a" / "model.safetensors").stat().st_ino
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert all(torch.equal(a[k], v) for k, v in load_file(str(c)).items())
    # A source holding something other than plain files is not linked: written instead, nothing half-linked.
    (tmp_path / "a" / "sub").mkdir()
    assert write_policy(model, tmp_path / "d", tok, frozen_from=tmp_path / "a") is False
    assert not (tmp_path / "d" / "sub").exists() and (tmp_path / "d" / "model.safetensors").is_file()
