"""The state layer as the engine sees it: ``EngineStateIO`` is the ``StateIO`` that
``trainer.initialize`` hands to every ``Engine`` (``trainer.zero.engine``), so the engine
saves, loads, exports and fills pretrained weights without importing this layer."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from trainer.state import checkpoint, export, pretrained
from trainer.zero.engine import Engine
from trainer.zero.init import WeightSource


class EngineStateIO:
    """Checkpoints (``trainer.state.checkpoint``), the 16-bit export (``trainer.state.export``)
    and pending pretrained weights (``trainer.state.pretrained``) for one engine."""

    def pending_weights(self, model: nn.Module) -> WeightSource | None:
        return pretrained.pending_source(model)

    def forget_pending(self, model: nn.Module) -> None:
        pretrained.forget_pending(model)

    def save_checkpoint(self, engine: Engine, save_dir: str | os.PathLike[str],
                        tag: str | None, client_state: dict[str, Any] | None, *,
                        save_latest: bool, exclude_frozen_parameters: bool) -> str:
        return checkpoint.save_checkpoint(
            engine, save_dir, tag, client_state=client_state, save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, engine: Engine, load_dir: str | os.PathLike[str],
                        tag: str | None, deepspeed_options: dict[str, bool]
                        ) -> tuple[str | None, dict[str, Any]]:
        options = checkpoint.LoadOptions.from_kwargs(deepspeed_options)
        return checkpoint.load_checkpoint(engine, load_dir, tag, options)

    def restore_module(self, engine: Engine, *, handover: bool = False) -> None:
        checkpoint.restore_module(engine, handover=handover)

    def save_16bit_model(self, engine: Engine, save_dir: str | os.PathLike[str],
                         save_filename: str, exclude_frozen_parameters: bool, *,
                         max_shard_size: int | str) -> bool:
        return export.save_16bit_model(engine, save_dir, save_filename,
                                       exclude_frozen_parameters,
                                       max_shard_size=max_shard_size)
