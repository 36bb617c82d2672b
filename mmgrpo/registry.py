"""Name registries: one per kind of component (advantage estimators, losses, samplers, rewards, SDE steps...).

Every registry gives the same `names()`, the same unknown-name error and the same keyword check; nothing else here.
"""

import difflib
import inspect
from collections.abc import Callable, Iterator
from typing import Any


class Registry:
    """A name -> callable table with metadata; registering a different object under a taken name raises."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Callable] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, obj: Callable | None = None, **meta: Any):
        """Register `obj` under `name` (usable as `@REG.register("name", key=value)`); meta is free-form."""

        def deco(fn: Callable) -> Callable:
            old = self._items.get(name)
            if old is not None and old is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to {old!r}; pick another name")
            self._items[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return deco(obj) if obj is not None else deco

    def get(self, name: str) -> Callable:
        """The callable registered as `name`; an unknown name raises ValueError listing the choices."""
        if name not in self._items:
            raise ValueError(self.unknown_message(name))
        return self._items[name]

    def unknown_message(self, name: Any) -> str:
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; choose from: {', '.join(self.names())}"

    def meta(self, name: str) -> dict[str, Any]:
        self.get(name)
        return self._meta[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def describe(self) -> dict[str, str]:
        """name -> first line of the registered object's docstring (for `names()` listings and the README)."""
        out = {}
        for name, fn in sorted(self._items.items()):
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            out[name] = self._meta[name].get("doc") or (doc[0] if doc else "")
        return out

    def check_kwargs(
        self, name: str, kwargs: dict[str, Any], *, field: str = "kwargs", skip: tuple = (), params=None
    ) -> None:
        """Raise ValueError when `kwargs` holds a keyword that `name`'s callable does not accept: `params` if given,
        else the fields of its `settings=` dataclass meta if it has one (a builder that takes **kwargs), else its
        signature."""
        if params is None:
            settings = self.meta(name).get("settings")
            params = inspect.signature(settings or self.get(name)).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        allowed = [p for p, v in params.items() if v.kind is not inspect.Parameter.POSITIONAL_ONLY and p not in skip]
        for key in kwargs:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"{field}: {self.kind} {name!r} takes no keyword {key!r}{hint}; it accepts: "
                    f"{', '.join(allowed) or 'no keywords'}"
                )

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
