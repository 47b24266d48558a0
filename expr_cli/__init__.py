"""The `expr` command: inspect runs, shards, history and per-rank reducer tables.

`expr_cli.main:entry` is the console script; each command group lives in its own
module with a `register(app)` function, and `expr_cli.render` is the only module
that knows rich.
"""
