"""What every request type shares: strict validation whose cost stays small whatever a body holds.

Pydantic reports every error it finds, and each costs microseconds and ~150 bytes of the 422
that names it, all while the event loop waits. A 14 MiB body of three million strings where
numbers belong was 6 million errors: 78 s of a stalled server and a 939 MiB answer. So:

- ``ListOf[T]``: a list whose validation stops at its first bad item (one error, not one per item);
  every list of a request type is one (``tests/e2e/test_bad_input.py`` walks the schemas).
- ``TextMap``: a dict of strings whose first value of another type is the one error.
- ``StrictRequest``: unknown fields are refused by name (a misspelt option is an error, never
  a silently ignored setting), and a body with more than ``MAX_UNKNOWN_NAMED`` of them is one
  error naming the first few, not one per field.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

T = TypeVar("T")
ListOf = Annotated[list[T], Field(fail_fast=True)]


def is_text(s: str) -> bool:
    """Whether ``s`` is Unicode text (JSON can escape a lone surrogate, which no id holds)."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def _first_non_text(value: Any) -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(item, str):
                raise ValueError(f"the value of {str(key)[:40]!r} must be a string, not {type(item).__name__}")
    return value


TextMap = Annotated[dict[str, str], BeforeValidator(_first_non_text)]

MAX_UNKNOWN_NAMED = 8


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _few_unknown(cls, data: Any) -> Any:
        # A few unknown fields are left to extra="forbid", which names each where it is.
        if isinstance(data, dict) and len(data) > len(cls.model_fields) + MAX_UNKNOWN_NAMED:
            known = _names(cls)
            unknown = [key for key in data if key not in known]
            if len(unknown) > MAX_UNKNOWN_NAMED:
                shown = ", ".join(repr(key)[:40] for key in unknown[:MAX_UNKNOWN_NAMED])
                raise ValueError(f"{len(unknown)} unknown fields ({shown}, ...): none is accepted")
        return data


@functools.cache
def _names(cls: type[BaseModel]) -> frozenset[str]:
    """The keys a body of ``cls`` may hold: its fields' names and aliases."""
    names = set(cls.model_fields)
    names.update(f.alias for f in cls.model_fields.values() if f.alias)
    names.update(f.validation_alias for f in cls.model_fields.values() if isinstance(f.validation_alias, str))
    return frozenset(names)
