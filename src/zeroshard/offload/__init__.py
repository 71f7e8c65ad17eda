"""Offload's public names: ``HostAdamW``, the host step — AdamW on fp32 master weights in
host memory through torch's fused CPU kernel, writing the compute-dtype weights to send
back in the same step. The engine places and moves offloaded state in
``runtime/offload.py``.
"""

from ..runtime.offload import CAST_DTYPES, HostAdamW

__all__ = ["CAST_DTYPES", "HostAdamW"]
