"""The `output_type=` of `history` and `read_run`: three kinds, with expr-tracker 0.4's aliases."""

from __future__ import annotations

# 0.4 took these spellings, in any case; each names one of the three kinds
ALIASES = {
    "pandas": "pandas", "pd": "pandas", "df": "pandas", "dataframe": "pandas",
    "arrow": "arrow", "pyarrow": "arrow", "pa": "arrow",
    "dict": "dict", "dicts": "dict", "records": "dict", "list": "dict",
}


def output_kind(value: object) -> str:
    """'pandas', 'arrow' or 'dict' for an `output_type` (ValueError listing the choices)."""
    kind = ALIASES.get(value.lower()) if isinstance(value, str) else None
    if kind is None:
        choices = ", ".join(repr(a) for a in ALIASES)
        raise ValueError(f"output_type must be one of {choices} (any case), got {value!r}")
    return kind
