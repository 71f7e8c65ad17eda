"""Offload: where the host (CPU) takes over the optimizer step from the device.

``HostAdamW`` is the host step: AdamW on fp32 master weights in host memory through
torch's fused CPU kernel, writing the compute-dtype weights to send back in the same step.
"""

from .host_adam import CAST_DTYPES, HostAdamW

__all__ = ["CAST_DTYPES", "HostAdamW"]
