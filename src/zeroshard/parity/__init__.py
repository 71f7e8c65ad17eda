"""Parity certificates (``zs.verify``, ``zeroshard verify``): the user's own configuration
run sharded and unsharded on the same batches, every tensor compared."""

from .certificate import Certificate
from .certify import verify

__all__ = ["Certificate", "verify"]
