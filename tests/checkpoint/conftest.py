"""The checkpoints' tests: sharded save and load at any N and stage on real gloo
ranks, export and import, ``torch.distributed.checkpoint`` and DeepSpeed's files, and
that no writer touches a file it did not write (the ``world`` fixture: a process group
of one, ``tests/conftest.py``)."""
