"""`expr serve`: a read-only web app over the run root (DESIGN 18).

`app` holds the routes, the token check and the headers; `api` answers the JSON API with
the same functions the CLI's `--json` uses (`expr_cli.data`); `live` keeps each run's
live state between requests; `paths` turns a URL's project/name into a run directory
under the root, or refuses. The pages are static files in `static/` (no build step).
Starlette and uvicorn (extra `serve`) are imported only by `app` and the command.
"""
