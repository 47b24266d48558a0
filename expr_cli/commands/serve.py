"""`expr serve`: the Distributed tab in a browser, read-only, over the run root (DESIGN 18).

Binds 127.0.0.1 by default. Any other host needs a token: `--token`, else one is made
here and printed in the URL (`http://HOST:PORT/?token=...`); the first visit turns it
into a cookie. `--port 0` takes a free port (the printed URL names it). Ctrl-C stops the
server: exit 130. starlette and uvicorn come with the `serve` extra, imported here only.
"""

from __future__ import annotations

import secrets
import signal
import socket
import sys

import typer

from expr_cli.errors import CLIError
from expr_cli.resolve import DIR_OPT, root_dir

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "")
DEFAULT_PORT = 8321


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here, so `--port 0` can print the port it got)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve_command(dir: str | None, host: str, port: int, token: str | None) -> int:
    """Serve the run root until Ctrl-C; the exit code."""
    from expr_cli.extras import require

    require("starlette", "serve")
    uvicorn = require("uvicorn", "serve")
    from expr_cli import render
    from expr_cli.web.app import make_app

    if not 0 <= port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {port}", 2)
    if token is not None and (len(token) < 8 or not token.isprintable() or " " in token):
        raise CLIError("--token must be at least 8 printable characters without spaces", 2)
    root = root_dir(dir)
    if root.exists() and not root.is_dir():
        raise CLIError(f"the run root {root} is not a directory (set --dir or $EXPR_DIR)")
    if not root.is_dir():
        raise CLIError(f"no run root at {root} (set --dir or $EXPR_DIR)")
    root = root.resolve()
    if token is None and host not in LOOPBACK:
        token = secrets.token_urlsafe(18)
    from expr_cli.commands.watch import health_config
    from expr_cli.web.conns import protocol
    from expr_tracker.stats import parallel

    try:
        http = protocol()  # a header deadline, and connections bound below the descriptors
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    sock = _bind(host, port)  # (first: a port taken is an error before anything starts)
    # while this process has one thread: uvicorn's request threads may not fork, and a
    # page of 16,384 ranks read on one core of two takes twice as long
    parallel.use_fork_server()
    app = make_app(root, token, health_config(None, {}))
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}/" + (f"?token={token}" if token else "")
    render.status(f"expr serve: {url}  (run root {root}; Ctrl-C stops)")
    if host in WILDCARD:  # every address: the URL another machine opens names this one
        there = url.replace(f"//{shown}:", f"//{socket.gethostname()}:", 1)
        render.status(f"expr serve: from another machine: {there}")
    sys.stdout.write(url + "\n")
    sys.stdout.flush()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=1, http=http)
    server = uvicorn.Server(config)
    code = 0
    # uvicorn raises a SIGTERM it shut down for again once done, with the handler it found:
    # the default one would end this process there, its fork server and workers left behind
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
        code = 130 if server.should_exit else 0
    except KeyboardInterrupt:
        code = 130
    except _Terminated:
        code = 128 + signal.SIGTERM
    finally:
        sock.close()
        parallel.stop_children()
        signal.signal(signal.SIGTERM, before)
    _exit_if_stuck(code)
    return code


class _Terminated(Exception):
    """SIGTERM reached `expr serve` (it stops as at Ctrl-C, then exits 143)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _exit_if_stuck(code: int) -> None:
    """Exit now when a request thread is still in a read (a stuck filesystem): the
    interpreter's exit would wait for it for good, and with it the fork server kept alive."""
    import os
    import threading

    stuck = [t for t in threading.enumerate()
             if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if not stuck:
        return
    from expr_cli import render

    render.status(f"expr serve: {len(stuck)} request thread(s) still reading; exiting without them")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def register(app: typer.Typer) -> None:
    """Add `expr serve`."""

    @app.command("serve", epilog="Example: expr serve --dir /shared/tracker/jsonl --port 0")
    def serve(
        dir: str | None = DIR_OPT,
        host: str = typer.Option("127.0.0.1", "--host", metavar="HOST",
                                 help="Address to listen on; any but loopback needs a token."),
        port: int = typer.Option(DEFAULT_PORT, "--port", metavar="PORT",
                                 help="Port to listen on (0: a free one, printed)."),
        token: str | None = typer.Option(None, "--token", metavar="TOKEN", show_default=False,
                                         help="Require this token (default for a non-loopback "
                                              "host: a generated one, printed in the URL)."),
    ) -> None:
        """The Distributed tab in a browser: runs, reducers, outliers, coverage, the
        heatmap and incidents of the runs under the run root, live, read-only.

        Prints the URL. 127.0.0.1 by default; any other --host requires a token (sent
        once as ?token=, then an HttpOnly cookie). Ctrl-C stops it. Needs the
        serve extra (starlette, uvicorn).
        """
        code = serve_command(dir, host, port, token)
        if code:
            raise typer.Exit(code)
