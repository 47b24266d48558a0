"""Alerting: the Alert value, its channels and configuration, the dispatcher, and rules/.

Submodules import each other downwards only (alert and config <- channels <- dispatch);
this package re-exports their public names so callers write `from expr_tracker.alerts import X`.
"""

from expr_tracker.alerts.alert import KINDS, Alert, format_line, make_alert, redact_url
from expr_tracker.alerts.channels import (
    MAX_RETRY_AFTER,
    Channel,
    CommandChannel,
    DeliveryError,
    LogChannel,
    SlackChannel,
    WebhookChannel,
    build_channel,
    slack_payload,
)
from expr_tracker.alerts.config import (
    CHANNEL_TYPES,
    CONFIG_ENV,
    LEVELS,
    AlertConfig,
    ChannelConfig,
    Policy,
    load_config,
)
from expr_tracker.alerts.dispatch import MAX_BACKOFF, Dispatcher

__all__ = [
    "CHANNEL_TYPES",
    "CONFIG_ENV",
    "KINDS",
    "LEVELS",
    "MAX_BACKOFF",
    "MAX_RETRY_AFTER",
    "Alert",
    "AlertConfig",
    "Channel",
    "ChannelConfig",
    "CommandChannel",
    "DeliveryError",
    "Dispatcher",
    "LogChannel",
    "Policy",
    "SlackChannel",
    "WebhookChannel",
    "build_channel",
    "format_line",
    "load_config",
    "make_alert",
    "redact_url",
    "slack_payload",
]
