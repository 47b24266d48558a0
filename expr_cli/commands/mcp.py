"""`expr mcp`: a Model Context Protocol server over stdio, read-only (DESIGN 20).

An MCP client (Claude Desktop, an agent framework) starts it as a subprocess and asks its
tools: the runs and their health, a run's reducers, its incidents with probes and crash
root, one rank against the median, runs compared, a metric's first crossing, a thinned
series and capped SQL (`expr_cli.mcp`). Needs the extra `mcp` (the official SDK).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from expr_cli.errors import CLIError
from expr_cli.resolve import root_dir

if TYPE_CHECKING:
    import typer


def mcp_command(dir: str | None, store: str | None, out: str | None, config: str | None,
                max_bytes: int, max_rows: int, points: int, sql_timeout: float,
                sql_memory: str, user_env: str | None = None,
                password_env: str | None = None, out_max: int | None = None) -> None:
    """Serve the tools over stdin/stdout until the client closes stdin."""
    from expr_cli.extras import require

    require("mcp", "mcp")
    from expr_cli.mcp.fit import Caps, OutDir
    from expr_tracker.views.sql import check_memory

    if not 4096 <= max_bytes <= 16 << 20:
        raise CLIError(f"--max-bytes must be in 4096..{16 << 20}, got {max_bytes}", 2)
    if not 1 <= max_rows <= 100_000:
        raise CLIError(f"--max-rows must be in 1..100000, got {max_rows}", 2)
    if not 2 <= points <= 100_000:
        raise CLIError(f"--points must be in 2..100000, got {points}", 2)
    if not (sql_timeout > 0 and math.isfinite(sql_timeout)):
        raise CLIError(f"--sql-timeout must be a positive number of seconds, got {sql_timeout:g}", 2)
    try:
        sql_memory = check_memory(sql_memory)
    except ValueError as exc:
        raise CLIError(f"--sql-memory: {exc}", 2) from None
    if store is not None:
        from expr_tracker.backends.registry import CLICKHOUSE_SECRET_PARAMS, check_url

        try:
            check_url(store, "--store", CLICKHOUSE_SECRET_PARAMS)
        except ValueError as exc:
            raise CLIError(str(exc), 2) from None
    root = root_dir(dir)
    if not root.is_dir():
        raise CLIError(f"no run root at {root} (set --dir or $EXPR_DIR)")
    root = root.resolve()
    out_dir = None
    if out is not None:
        out_dir = Path(out).expanduser().resolve()
        if out_dir == root or root in out_dir.parents:
            raise CLIError("--out must be outside the run root (the server only reads there)", 2)
        if out_dir.exists() and not out_dir.is_dir():
            raise CLIError(f"--out {out} is not a directory", 2)
    from expr_cli.commands.watch import health_config
    from expr_cli.mcp.server import build_server
    from expr_tracker.stats import parallel

    if out_max is not None and out_max < 0:
        raise CLIError(f"--out-max must be a number of bytes >= 0, got {out_max}", 2)
    caps = Caps(answer_bytes=max_bytes, rows=max_rows, points=points, sql_seconds=sql_timeout,
                sql_memory=sql_memory, out_bytes=Caps.out_bytes if out_max is None else out_max)
    cfg = health_config(config, {})
    # while this process has one thread: the tools run on the SDK's worker threads, which
    # may not fork; a fork server's workers read the shards of a big run (as expr serve)
    parallel.use_fork_server()
    server = build_server(root, caps, OutDir(out_dir, caps.out_bytes), cfg, store, user_env,
                          password_env)
    try:
        server.run("stdio")
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    """Add `expr mcp`."""
    import typer

    from expr_cli.mcp.fit import Caps
    from expr_cli.resolve import DIR_OPT

    defaults = Caps()

    @app.command("mcp", epilog="Example (an MCP client's config): "
                               '{"mcpServers": {"expr": {"command": "expr", "args": '
                               '["mcp", "--dir", "/shared/tracker/jsonl"]}}}')
    def mcp(
        dir: str | None = DIR_OPT,
        store: str | None = typer.Option(None, "--store", metavar="URL", show_default=False,
                                         help="The team store (ClickHouse HTTP URL) for the "
                                              "query tool."),
        out: str | None = typer.Option(None, "--out", metavar="DIR", show_default=False,
                                       help="Write answers over the size cap, whole, as files "
                                            "here (default: none, answers are cut)."),
        out_max: int = typer.Option(defaults.out_bytes, "--out-max", metavar="N",
                                    help="Bytes --out may hold in all, its earlier files too."),
        config: str | None = typer.Option(None, "--config", "-c", metavar="FILE",
                                          show_default=False,
                                          help="Alert config whose \\[health] table sets the "
                                               "detectors' thresholds."),
        max_bytes: int = typer.Option(defaults.answer_bytes, "--max-bytes", metavar="N",
                                      help="Size cap of one answer, in bytes of JSON."),
        max_rows: int = typer.Option(defaults.rows, "--max-rows", metavar="N",
                                     help="SQL rows in one answer."),
        points: int = typer.Option(defaults.points, "--points", metavar="N",
                                   help="Points per line of a series."),
        sql_timeout: float = typer.Option(defaults.sql_seconds, "--sql-timeout",
                                          metavar="SECONDS", help="Time cap of a query."),
        sql_memory: str = typer.Option(defaults.sql_memory, "--sql-memory", metavar="SIZE",
                                       help="Memory cap of a query (DuckDB's memory_limit, "
                                            "ClickHouse's max_memory_usage)."),
        user_env: str | None = typer.Option(None, "--user-env", metavar="VAR",
                                            show_default=False,
                                            help="With --store: the variable holding the "
                                                 "user name."),
        password_env: str | None = typer.Option(None, "--password-env", metavar="VAR",
                                                show_default=False,
                                                help="With --store: the variable holding the "
                                                     "password."),
    ) -> None:
        """An MCP server over stdio for agents: computed answers about the runs under the
        run root, read-only.

        Tools: list_runs, run_summary, run_incidents, rank_vs_median, compare_runs,
        first_crossing, metric_series, query. Every answer says what it covers and whether
        it was cut to the size cap. Needs the mcp extra: pip install 'expr-tracker[mcp]'.
        """
        mcp_command(dir, store, out, config, max_bytes, max_rows, points, sql_timeout,
                    sql_memory, user_env, password_env, out_max)
