"""The sharded model the user holds: its collaborators, the hooks that drive its passes,
and what it gives out (state dicts, full weights, bytes held and sent)."""
