"""The Qwen2/Qwen3/Llama decoder, its presets, and HF checkpoint + tokenizer I/O."""

from exactrl.model.config import PRESETS, ModelConfig, preset
from exactrl.model.qwen import CausalLM, build_model, count_params

__all__ = ["PRESETS", "CausalLM", "ModelConfig", "build_model", "count_params", "preset"]
