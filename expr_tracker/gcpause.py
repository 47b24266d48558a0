"""The cyclic garbage collector paused around a bulk read.

A read of thousands of shard tails makes millions of dicts and lists, none in a cycle
(reference counting frees them), and each few hundred thousand allocations set off a
collection that walks every object alive: at 16,384 shards those collections were a
sixth to a third of a read's CPU time (bench/HISTORY.md, issue 24). What the read leaves
behind is collected as usual once it is over.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic collection inside the block (as it was before it, after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
