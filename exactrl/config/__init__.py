"""Typed run configuration: dataclasses, TOML in and out, ``--set`` overrides, validation.

A run is described by one TOML file with one table per section (``[run]``, ``[model]``, ``[engine]``,
``[sampling]``, ``[task]``, ``[reward]``, ``[algorithm]``, ``[train]``, ``[sft]``). Every key is optional; a
missing key keeps the default written below. Command-line overrides use ``section.key=value`` where the
value is a TOML literal (``1e-5``, ``true``, ``[1, 2]``, ``"x"``); a bare word that is not valid TOML is taken
as a string. TOML has no null: on a field that may be None, the strings ``none`` / ``null`` mean None.

The package, bottom to top: ``errors`` (ConfigError and the checks), one module per section or group of sections
(``run``, ``model``, ``engine``, ``task``, ``algorithm``, ``train``), ``schema`` (:class:`RunConfig` and the
checks that span sections); then the machinery, generic over any tree of dataclasses: ``fields`` (dict ->
dataclasses, type-checked), ``overrides`` (``--set``), ``loading`` (:func:`load_config`, the relative-path rule),
``writing`` (:func:`dump_toml`), ``reference`` (:func:`field_docs`, the Markdown reference). Every field carries a
docstring (a string literal right after it), which :func:`config_reference_markdown` renders into the reference.

``python -m exactrl.config`` prints the Markdown reference; ``python -m exactrl.config --toml`` prints the
defaults as TOML.
"""

from __future__ import annotations

import sys

from exactrl.config.algorithm import (
    ALGORITHM_PRESETS,
    GROUP_BASELINE_ADVANTAGES,
    AdvantageName,
    AdvScale,
    Aggregation,
    AlgorithmConfig,
    AlgorithmName,
    DynamicSampling,
    KLControllerKind,
    KLKind,
    Overlap,
    PolicyLossName,
    RolloutCorrection,
)
from exactrl.config.engine import EngineConfig, SamplingConfig
from exactrl.config.errors import ConfigError
from exactrl.config.fields import config_from_dict, config_to_dict
from exactrl.config.loading import check_path_anchors, load_config, relative_path_refs
from exactrl.config.model import LORA_TARGETS, Dtype, LoraConfig, LoraInit, ModelConfig
from exactrl.config.overrides import apply_overrides, parse_override
from exactrl.config.reference import config_reference_markdown, field_docs
from exactrl.config.run import RunSection
from exactrl.config.schema import TAIL_OVERLAP_ADVANTAGES, RunConfig, episode_token_limit, resolve_device
from exactrl.config.task import ARITHMETIC_OPS, EnvConfig, RewardConfig, TaskConfig, TaskName
from exactrl.config.train import DistributedConfig, LRSchedule, SFTConfig, TrainConfig
from exactrl.config.writing import _toml_value, dump_toml, save_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = [
    "ALGORITHM_PRESETS",
    "ARITHMETIC_OPS",
    "GROUP_BASELINE_ADVANTAGES",
    "LORA_TARGETS",
    "TAIL_OVERLAP_ADVANTAGES",
    "AdvScale",
    "AdvantageName",
    "Aggregation",
    "AlgorithmConfig",
    "AlgorithmName",
    "ConfigError",
    "DistributedConfig",
    "Dtype",
    "DynamicSampling",
    "EngineConfig",
    "EnvConfig",
    "KLControllerKind",
    "KLKind",
    "LRSchedule",
    "LoraConfig",
    "LoraInit",
    "ModelConfig",
    "Overlap",
    "PolicyLossName",
    "RewardConfig",
    "RolloutCorrection",
    "RunConfig",
    "RunSection",
    "SFTConfig",
    "SamplingConfig",
    "TaskConfig",
    "TaskName",
    "TrainConfig",
    "_toml_value",
    "apply_overrides",
    "check_path_anchors",
    "config_from_dict",
    "config_reference_markdown",
    "config_to_dict",
    "dump_toml",
    "episode_token_limit",
    "field_docs",
    "load_config",
    "parse_override",
    "relative_path_refs",
    "resolve_device",
    "save_config",
    "tomllib",
]
