"""Settings documented once: each config field carries its description and its bounds.

A config dataclass declares a field with `setting(default, "what it does", ge=0, ...)`; its
`__post_init__` calls `check_settings(self)`, which enforces every declared bound with an
error naming the field. `pdserve serve --help` and docs/config.md are generated from the
same declarations (`pdserve.config_docs`), so a setting is written down in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

_KEY = "pdserve"


@dataclass(frozen=True)
class Bounds:
    """What a value may be; None: no such bound. `zero` says what 0 means where 0 is
    allowed outside the other bounds (e.g. "off", "no limit")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: Sequence[object] | None = None
    zero: str | None = None
    power_of_two: bool = False

    def violation(self, value: Any) -> str | None:
        """Why `value` is out of bounds, or None when it is within them."""
        if value is None or isinstance(value, bool):
            return None
        if self.choices is not None:
            return None if value in self.choices else f"choose from {list(self.choices)}"
        if not isinstance(value, int | float):
            return None
        if self.zero is not None and value == 0:
            return None
        if self.ge is not None and value < self.ge:
            return f"must be >= {self.ge:g}"
        if self.gt is not None and value <= self.gt:
            return f"must be > {self.gt:g}"
        if self.le is not None and value > self.le:
            return f"must be <= {self.le:g}"
        if self.power_of_two and (int(value) != value or int(value) & (int(value) - 1)):
            return "must be a power of two"
        return None

    def text(self) -> str:
        """The bounds in words, for --help and the docs."""
        parts = []
        if self.choices is not None:
            parts.append(" | ".join(str(c) for c in self.choices))
        if self.gt is not None:
            parts.append(f"> {self.gt:g}")
        if self.ge is not None:
            parts.append(f">= {self.ge:g}")
        if self.le is not None:
            parts.append(f"<= {self.le:g}")
        if self.power_of_two:
            parts.append("a power of two")
        if self.zero is not None:
            parts.append(f"0: {self.zero}")
        return ", ".join(parts)


def setting(
    default: Any = MISSING,
    doc: str = "",
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: Sequence[object] | None = None,
    zero: str | None = None,
    power_of_two: bool = False,
    secret: bool = False,
) -> Any:
    """A dataclass field with its description and bounds. `secret`: kept out of repr and
    masked wherever the config is printed."""
    assert doc, "every setting says what it does"
    bounds = Bounds(ge, gt, le, choices, zero, power_of_two)
    meta = {_KEY: (doc, bounds)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta, repr=not secret)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def doc_of(f: dataclasses.Field[Any]) -> tuple[str, Bounds] | None:
    """A field's description and bounds; None for a field that is no setting (a section)."""
    got = f.metadata.get(_KEY)
    return got if got is None else (got[0], got[1])


def check_settings(obj: Any, where: str = "", error: type[ValueError] = ValueError) -> None:
    """Raise `error` naming the first setting of `obj` outside its declared bounds."""
    for f in fields(obj):
        meta = doc_of(f)
        if meta is None:
            continue
        why = meta[1].violation(getattr(obj, f.name))
        if why is not None:
            raise error(f"{where}{f.name}={getattr(obj, f.name)!r} {why}")
