"""Adapters for the trainers people already use; each imports its library only when imported.

    from expr_tracker.integrations.transformers import ExprTrackerCallback
    from expr_tracker.integrations.lightning import ExprTrackerLogger
    from expr_tracker.integrations.accelerate import ExprTrackerTracker

Every adapter calls `init` on every process, so each rank writes its own shard, and uses
only the public SDK (`init`, `log`, `finish`, `Run`).
"""
