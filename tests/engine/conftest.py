"""The engine's tests. Each file's multi-process cases run as one grid in one spawn of
real gloo ranks (``zeroshard.runtime.spawn``: fresh processes, so a crash in one file's
grid cannot hide the next), against torch DDP or a single process on the same batches;
the grids and their models live in ``engine_cases.py`` (and ``user_models.py``,
``optimizer_cases.py``, ``lora_cases.py``, ``tp_cases.py``, ``compile_cases.py``), so
the ranks can unpickle them by name. Unit tests beside them need no process group.
"""
