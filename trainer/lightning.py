"""``from trainer.lightning import OffloaddStrategy``: Lightning's strategy for offloadd
(``trainer.integrations.lightning``)."""

from trainer.integrations.lightning import CHECKPOINT_TAG, OffloaddStrategy, UnsupportedVersionError

__all__ = ["CHECKPOINT_TAG", "OffloaddStrategy", "UnsupportedVersionError"]
