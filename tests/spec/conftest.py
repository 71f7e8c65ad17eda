"""The spec's tests: ``ZeroConfig``, its rules and the ``ShardPolicy``, torch-free."""
