"""The engine: process groups, units and their shards, hooks, collectives, optimizer glue."""
