"""Rank side of offloadd: a ZeRO engine with a DeepSpeed-compatible ``initialize()``.

    engine, optimizer, _, lr_scheduler = trainer.initialize(
        model=model, model_parameters=model.parameters(), config=cfg)
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

from trainer.api import add_config_arguments, initialize
from trainer.config import EngineConfig, parse_config
from trainer.dist import comm
from trainer.dist.distributed import init_distributed
from trainer.state.pretrained import LoadReport, PretrainedError, load_pretrained
from trainer.zero.engine import Engine
from trainer.zero.optimizer import ZeroOptimizer
from trainer.zero.trace import TraceDivergenceError

__all__ = ["Engine", "EngineConfig", "LoadReport", "PretrainedError", "TraceDivergenceError",
           "ZeroOptimizer", "add_config_arguments", "comm", "init_distributed", "initialize",
           "load_pretrained", "parse_config"]
