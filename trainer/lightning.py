"""``from trainer.lightning import OffloaddStrategy``: Lightning's strategy for offloadd
(``trainer.integrations.lightning``)."""

from trainer.integrations.lightning import (
    CHECKPOINT_TAG,
    OffloaddStrategy,
    TwinAccelerator,
    UnsupportedVersionError,
    convert_zero_checkpoint_to_fp32_state_dict,
)

__all__ = ["CHECKPOINT_TAG", "OffloaddStrategy", "TwinAccelerator", "UnsupportedVersionError",
           "convert_zero_checkpoint_to_fp32_state_dict"]
