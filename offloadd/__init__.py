"""offloadd: a per-node offload daemon for training models larger than GPU memory."""

__version__ = "0.1.0"
