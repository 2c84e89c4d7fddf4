"""Where a process gets its model: a checkpoint directory or a named preset.

Router and workers call the same functions, so they agree on the model's
name (which enters the block-key namespace), its context and vocabulary.
A checkpoint that cannot be served raises one of MODEL_ERRORS, whose message
names the file and field; the CLIs print it as one line at startup. Nothing
here imports torch (the router imports this module); the weights themselves come from
prefixpool.engine.checkpoint.build_model.
"""

from __future__ import annotations

from pathlib import Path

from prefixpool.model.config_file import CheckpointError, read_config
from prefixpool.model.config import ConfigError, ModelConfig, namespace_for, preset, with_name
from prefixpool.model.chat_template import ChatTemplateError
from prefixpool.model.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from prefixpool.store.keys import Namespace

MODEL_ERRORS = (ConfigError, CheckpointError, TokenizerError, ChatTemplateError)


def model_config(model: str, model_path: str) -> ModelConfig:
    """The config of `model_path`'s checkpoint (served as `model`), else the preset `model`."""
    return with_name(read_config(model_path), model) if model_path else preset(model)


def tokenizer_for(model_path: str) -> Tokenizer:
    """The checkpoint's tokenizer.json when it has one, else the byte-level tokenizer."""
    return load_tokenizer(Path(model_path) if model_path else "")


def cache_namespace(config: ModelConfig, dtype: str, block_size: int) -> Namespace:
    return namespace_for(config, dtype, block_size)
