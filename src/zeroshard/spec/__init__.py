"""What a configuration means, written once and read by both the planner and the engine.

``zeroshard.spec`` imports neither ``zeroshard.plan`` nor ``zeroshard.runtime``, and never
torch: the planner (pure Python) and the engine (torch) both build on it, so the bytes
the planner predicts and the tensors the engine allocates come from one definition.

- ``config``: :class:`ZeroConfig`, every stage × option rule checked once, one message each
  (``ZeroConfig.at_stage``: the most of it another stage takes; ``PLANNED_DISK``: a disk
  placement without a folder, for plans);
- ``policy``: :class:`ShardPolicy`, what a stage means (the engine's and the planner's only
  judge of a stage number);
- ``recipes``: precision recipes, bytes per parameter per category;
- ``dims``: :class:`ParallelDims`, the sizes of the mesh's axes (data-parallel replicate ×
  shard, hpZ's secondary groups, tensor parallel) and their checks;
- ``deepspeed``: a DeepSpeed JSON config read into ``ZeroConfig``'s fields;
- ``formulas``: the constants and ring formulas both sides count bytes with.
"""
