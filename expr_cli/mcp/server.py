"""The MCP server of `expr mcp`: the tools, registered with the official `mcp` SDK
(`MCPServer`, stdio), each a thin call of `answers.Answers` whose result goes through
`fit` (the size cap) and out as one compact JSON text.

Read-only: every tool is annotated `readOnlyHint`; the only files written are the larger
pulls under the output directory. A failure the caller can act on (a bad argument, a run
that is not there, SQL refused or stopped at a cap) is a tool error whose message says
which; anything else is the SDK's generic tool error, its traceback on stderr.
"""

# (no `from __future__ import annotations`: the SDK evaluates the tools' annotations, some
# of which name the caps of the server being built)
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import orjson
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from expr_cli.data import jsonable
from expr_cli.errors import CLIError

from .answers import Answers, BadArgument, NoRun
from .fit import Caps, OutDir, fit
from .sql import SQLRefused, ViewCache, run_sql, run_store_sql
from .steps import StepAnswers

INSTRUCTIONS = """\
Answers about distributed training runs recorded by expr-tracker: per-rank health,
cross-rank reducers, incidents (stalls, crashes, stragglers), and SQL over the records.
Start with list_runs (worst first), then run_incidents for a run in trouble (the
culprit rank, where each rank waits, the crash root) and run_summary for its metrics.
Every answer has `covers` (ranks reporting of the world size, ranks missing, steps) and
`cut` (true when lists were shortened to fit; `file` then holds the whole answer when
the server has an output directory). Runs are `project/name` or a bare name."""

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                            open_world_hint=False)

Run = Annotated[str, Field(description="The run: project/name, or a run name (list_runs).")]
Stream = Annotated[str | None, Field(description="A stream of the run (default: the default "
                                                 "stream).")]
Metric = Annotated[str, Field(description="A metric key: logged with et.log (step rows) or "
                                          "log_rank_metrics (rank records).")]


def build_server(root: Path, caps: Caps, out: OutDir, cfg: Any, store: str | None = None,
                 user_env: str | None = None, password_env: str | None = None) -> MCPServer:
    """The server over run root `root`: its tools, caps and output directory."""
    answers = Answers(root, caps, cfg)
    steps_of = StepAnswers(answers)
    views = ViewCache()
    server = MCPServer("expr-tracker", instructions=INSTRUCTIONS, version=_version(),
                       log_level="WARNING")
    store_url = store

    def failed(text: str) -> ToolError:
        """A tool error whose text is capped like an answer (it may quote an argument of
        megabytes)."""
        data = text.encode()
        room = caps.answer_bytes - 256  # (the SDK puts "Error executing tool NAME: " first)
        if len(data) > room:
            more = f"... ({len(data):,} bytes, cut to the answer cap)"
            text = data[:room - len(more)].decode(errors="ignore") + more
        return ToolError(text)

    def answer(tool: str, call: Callable[[], dict[str, Any]]) -> str:
        try:
            result = call()
        except (BadArgument, NoRun) as exc:
            raise failed(str(exc)) from None
        except SQLRefused as exc:
            raise failed(f"sql: {exc}") from None
        except CLIError as exc:
            raise failed(exc.message.replace(str(root), "the run root")) from None
        except (OSError, ValueError) as exc:
            raise failed(f"{type(exc).__name__}: {exc}".replace(str(root), "the run root")
                         ) from None
        result = fit(tool, jsonable(result), caps.answer_bytes, out)
        return orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS).decode()

    def tool(fn: Callable[..., str]) -> Callable[..., str]:
        server.add_tool(fn, annotations=READ_ONLY, structured_output=False)
        return fn

    @tool
    def list_runs() -> str:
        """The runs under the run root, worst first (open incidents, a stall, crashed, stale,
        live, finished): status, ranks, last step, last write, open incidents and, for runs
        under 1,024 ranks, the job's line from the detectors (stalled and its suspects,
        crashed and the first rank to fail)."""
        return answer("list_runs", answers.runs)

    @tool
    def run_summary(
        run: Run,
        metrics: Annotated[list[str] | None, Field(description="Keys to reduce (default: "
                                                               "every rank-record key).")] = None,
        step: Annotated[int | None, Field(strict=True, description="One step (default: the frontier, the "
                                                      "latest step every live rank reported)."
                                          )] = None,
        steps: Annotated[str | None, Field(description="A half-open window START:STOP: "
                                                       "statistics of per-rank means.")] = None,
        stream: Stream = None,
    ) -> str:
        """Cross-rank reducers of a run at a step or over a window, exactly `expr summary
        --json`: per key n/world, mean, wmean, min, max, std, p05, p50, p95, the missing and
        behind ranks, outlier ranks (robust z > 3.5), and which recent steps miss ranks."""
        return answer("run_summary", lambda: answers.summary(run, metrics, step, steps, stream))

    @tool
    def run_incidents(run: Run, stream: Stream = None) -> str:
        """A run's health: the job's line (running, stalled and its suspect ranks, crashed
        and the rank that failed first), the open incidents (the detectors now and a
        watcher's), past incidents, where each rank waits (its probe: the innermost frames,
        collective or not) and the crash root (rank, host, exception, message)."""
        return answer("run_incidents", lambda: answers.incidents(run, stream))

    @tool
    def rank_vs_median(
        run: Run,
        rank: Annotated[int, Field(description="The rank to look at.", strict=True)],
        stream: Stream = None,
    ) -> str:
        """One rank against the ranks' median: its step time (the step_time rank metric,
        else the gaps between its steps), its system metrics (CPU, RSS, GPU clock,
        temperature, power, throttling) and latest rank metrics, what stands out, its state,
        steps behind, probe and the incidents naming it."""
        return answer("rank_vs_median", lambda: answers.rank(run, rank, stream))

    @tool
    def compare_runs(
        runs: Annotated[list[str], Field(description="2 to 8 runs (project/name).")],
        metric: Metric,
        points: Annotated[int | None, Field(description="At most this many aligned steps "
                                                        f"(default and most {caps.points}).")
                          ] = None,
        stream: Stream = None,
    ) -> str:
        """Several runs on one metric: per run the median across its ranks at each step,
        aligned by step (thinned), with each run's last, lowest and highest median and its
        value at the last step they all reached."""
        return answer("compare_runs", lambda: steps_of.compare(runs, metric, stream, points))

    @tool
    def first_crossing(
        run: Run,
        metric: Metric,
        value: Annotated[float, Field(description="The threshold.")],
        direction: Annotated[str, Field(description="'above' (>= value) or 'below' "
                                                    "(<= value).")] = "above",
        stream: Stream = None,
    ) -> str:
        """The first step at which a metric reached a value: on any rank (and which), on
        the median across ranks, how many ranks ever did and which never did."""
        return answer("first_crossing",
                      lambda: steps_of.crossing(run, metric, value, direction, stream))

    @tool
    def metric_series(
        run: Run,
        metric: Metric,
        ranks: Annotated[str | None, Field(description="'all' (default), a rank or a list "
                                                       "like 0,3,5-7.")] = None,
        steps: Annotated[str | None, Field(description="A half-open step range A:B.")] = None,
        points: Annotated[int | None, Field(strict=True, description="Points per line (default and most "
                                                        f"{caps.points}).")] = None,
        stream: Stream = None,
    ) -> str:
        """A metric over steps, `expr plot --json` thinned to bounded points: one line per
        rank up to 8 ranks; past that the median, the p05-p95 band and the outlier ranks'
        own lines."""
        return answer("metric_series",
                      lambda: steps_of.series(run, metric, ranks, steps, points, stream))

    sql_doc = (f"at most {caps.rows} rows and {caps.answer_bytes // 2:,} bytes in the answer"
               + (f", the rest as a file under the output directory (up to {caps.file_rows:,}"
                  " rows)" if out.fd is not None else "")
               + f"; {caps.sql_seconds:g} s and {caps.sql_memory} of memory")

    def query_runs(
        sql: Annotated[str, Field(description="One SELECT statement.")],
        run: Annotated[str | None, Field(description="The run whose views to query (DuckDB)."
                                         )] = None,
        store: Annotated[bool, Field(description="Query the team store (ClickHouse) instead "
                                                 "of a run.")] = False,
    ) -> str:
        def call() -> dict[str, Any]:
            if store:
                if not store_url:
                    raise BadArgument("store", "expr mcp was started without --store URL")
                if run is not None:
                    raise BadArgument("run", "give either run or store, not both")
                res = run_store_sql(store_url, sql, caps, out, user_env=user_env,
                                    password_env=password_env)
                return {"tool": "query", "covers": {"source": "team store",
                                                    "rows": res["n_rows"]}, **res}
            if run is None:
                raise BadArgument("run", "name the run whose views to query (or store=true)")
            ref = answers.run(run)
            if not sql.strip():
                raise BadArgument("sql", "give one SELECT statement")
            res = run_sql(ref, sql, caps, out, views)
            return {"tool": "query", "covers": {"source": f"run {ref.label}",
                                                "rows": res["n_rows"]}, **res}

        return answer("query", call)

    query_runs.__doc__ = (
        "Read-only SQL. Over a run (DuckDB): views metrics (step rows of every rank: _rank, "
        "_stream, _step, _time and one column per key), ranks (rank records: also "
        "_world_size, _local_rank, _weight), alerts and incidents"
        + ("; or, with store=true, the team store (ClickHouse: expr.metrics, "
           "expr.rank_metrics, expr.runs, expr.alerts, expr.incidents; FINAL to collapse "
           "replays)" if store else "")
        + f". One SELECT; caps: {sql_doc}. Aggregate in SQL rather than pulling rows.")
    server.add_tool(query_runs, name="query", annotations=READ_ONLY, structured_output=False)
    return server


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("expr-tracker")
    except PackageNotFoundError:
        from expr_tracker import __version__

        return __version__
