"""The order of a pass's collectives: backward's reductions issued in one order on every
rank, packed per bucket, and stage 3's gathers prefetched by the last pass's order."""
