"""Llama-family models built from local HF checkpoints (see `loader.load_model`)."""

from engine.models.llama import LlamaForCausalLM
from engine.models.loader import ModelInfo, load_model, read_model_info
from engine.models.spec import ModelSpec

__all__ = ["LlamaForCausalLM", "ModelInfo", "ModelSpec", "load_model", "read_model_info"]
