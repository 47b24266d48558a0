"""Whole runs as tables: export to parquet/CSV/JSONL and pandas/Arrow (export), SQL views over DuckDB (sql)."""
