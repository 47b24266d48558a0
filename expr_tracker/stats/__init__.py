"""Cross-rank statistics: rank tables, reducers and outliers (pure), and the columnar shard scan."""
