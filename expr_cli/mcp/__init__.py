"""`expr mcp`: the tracker's answers over the Model Context Protocol (DESIGN 20).

`server` registers the tools with the `mcp` SDK (the extra `mcp`, imported only there);
`answers` (a run's state: runs, reducers, incidents, one rank) and `steps` (a metric over
steps) compute each tool's answer from the functions behind the CLI's `--json`
(`expr_cli.data`), over the live states `expr serve` keeps (`expr_cli.web.live`); `sql`
runs read-only SQL under caps the databases enforce; `fit` keeps every answer under the
size cap and writes a larger pull as a file under the output directory.
"""
