"""The layer probe's names, where the guard's readers import them from. A run's mismatch report runs the probe at an
abort, so it lives in the training layer (exactrl/train/layer_probe.py)."""

from exactrl.train.layer_probe import ExpertProbe, LayerProbe, probe_layers

__all__ = ["ExpertProbe", "LayerProbe", "probe_layers"]
