"""A checkpoint directory's config.json, read without its weights.

    <dir>/config.json  ->  ModelConfig named after <dir>, or one CheckpointError naming the file

Apart from prefixpool.engine.checkpoint (which loads the tensors) so the router,
which only needs the geometry and vocabulary, never imports torch. Knows
nothing of tensors or tokenizers.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixpool.model.config import ConfigError, ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded into the model its config describes."""


def read_config(path: str | Path) -> ModelConfig:
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    try:
        return ModelConfig.from_hf(json.loads(config_file.read_text()), name=directory.name)
    except (json.JSONDecodeError, ConfigError) as err:
        raise CheckpointError(f"{config_file}: {err}") from err
