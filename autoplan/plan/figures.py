"""The figures a plan file holds, and the strictness of its records, shared by the plan's modules.

Counts, bytes and seconds are never negative; no float is NaN or infinite; a record holds only its own
fields (a misspelt key is an error, not a silently ignored one).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Count", "Seconds", "StrictRecord"]

Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]


class StrictRecord(BaseModel):
    """A plan file record: extra keys refused, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
