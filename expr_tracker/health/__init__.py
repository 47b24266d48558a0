"""Live job health (DESIGN 13): a run's live state and frontier, detectors, incidents.

`state` reads sidecars and shard tails (`read_run`, `RunReader`, `RunState`, `RankState`);
the modules above it judge that state and record incidents. Used by `expr watch`,
`expr top`, `expr summary` (the frontier) and exprd; the SDK never imports it.
"""
