"""Files on disk: names (layout), record encoding (records), shards and sidecars (shard)."""
