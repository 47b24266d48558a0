"""`expr_tracker.errors`: the exception tree and the one message of an unknown config key."""

from __future__ import annotations

import pytest

from expr_tracker.errors import TrackerError, UsageError, unknown_key


def test_unknown_key_names_the_close_one_and_every_allowed():
    assert unknown_key("health", "hang_afer", ("hang_after", "behind_steps")) == (
        "health: unknown key 'hang_afer' (did you mean 'hang_after'? allowed: hang_after, "
        "behind_steps)")
    assert unknown_key("", "zzz", ("spool", "state")) == "unknown key 'zzz' (allowed: spool, state)"


def test_every_config_table_says_which_key_it_meant():
    from expr_tracker.alerts import load_config
    from expr_tracker.health.config import parse_health

    with pytest.raises(ValueError, match=r"^health: unknown key 'hang_afer' \(did you mean 'hang_after'\?"):
        parse_health({"hang_afer": "8s"})
    with pytest.raises(ValueError, match=r"unknown key 'urll' \(did you mean 'url'\?"):
        load_config({"channels": {"ops": {"type": "webhook", "urll": "http://x"}}})
    with pytest.raises(ValueError, match=r"^alert policy: unknown key 'retires' \(did you mean 'retries'\?"):
        load_config({"policy": {"retires": 3}})


def test_usage_errors_are_tracker_errors():
    assert issubclass(UsageError, TrackerError) and issubclass(UsageError, RuntimeError)
