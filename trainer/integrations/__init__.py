"""The faces other tools expect: the DeepSpeed facade (``deepspeed.*`` modules for HF and
Accelerate), Lightning's strategy, argparse/config compatibility and version checks.

Imports every layer below; only ``demo`` and the user entry modules sit above it.
"""
