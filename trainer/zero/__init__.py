"""The ZeRO engine: units and partitions, gathers and hooks, stages 1-3, ``zero.Init``,
parameter groups, precision, LR schedules, the optimizer front and the gather trace.

Imports ``device``, ``dist``, ``offload`` and the rank side's config; what it needs of
checkpoints and pretrained weights is handed in (``StateIO``, ``WeightSource``).
"""

from trainer.zero.external import register_external_parameter, unregister_external_parameter
from trainer.zero.gathered import GatheredParameters
from trainer.zero.init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter",
           "unregister_external_parameter"]
