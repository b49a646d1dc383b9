"""The daemon's CUDA side: copiers that move arena bytes into ranks' GPU staging buffers
(cupy streams and IPC handles, or the timed twin), knowing nothing of jobs or sessions.

Imports ``memory`` and the contract.
"""
