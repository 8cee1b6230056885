"""load_policy's device argument: a string or a torch.device, and a clear error for anything else."""

from __future__ import annotations

import pytest
import torch

from exactrl.model.loading import load_policy, resolve_device


def test_resolve_device_takes_a_torch_device_and_refuses_other_types() -> None:
    assert resolve_device(torch.device("cpu")) == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(TypeError, match="device must be a string"):
        resolve_device(0)  # type: ignore[arg-type]


def test_load_policy_on_a_torch_device() -> None:
    model, _ = load_policy(preset_name="tiny", device=torch.device("cpu"), dtype="float32")
    assert next(model.parameters()).device == torch.device("cpu")
