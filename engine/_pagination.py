"""Cursor pagination of lists, as the OpenAI API does it (`after`, `limit`, `order`).

A page is `{"object": "list", "data", "first_id", "last_id", "has_more"}`; `after` is the id
of the item before the page (an unknown id gives an empty page).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from ._asgi import HttpError, error_body

__all__ = ["DEFAULT_PAGE_LIMIT", "MAX_PAGE_LIMIT", "PageQuery"]


class _Identified(Protocol):
    @property
    def id(self) -> str | None: ...


_T = TypeVar("_T", bound=_Identified)

# Items a page, as the OpenAI API: 1..100, 20 by default.
MAX_PAGE_LIMIT = 100
DEFAULT_PAGE_LIMIT = 20


@attrs.frozen(kw_only=True)
class PageQuery:
    limit: int = DEFAULT_PAGE_LIMIT
    order: str = "desc"  # "asc" or "desc"
    after: str | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> PageQuery:
        """The page a query string asks for; a 400 `HttpError` naming the bad parameter."""
        try:
            limit = int(query.get("limit", DEFAULT_PAGE_LIMIT))
        except ValueError:
            limit = -1
        order = query.get("order", "desc")
        if not 1 <= limit <= MAX_PAGE_LIMIT or order not in ("asc", "desc"):
            param = "order" if order not in ("asc", "desc") else "limit"
            raise HttpError(
                400,
                error_body(
                    f"Invalid '{param}': limit is 1..{MAX_PAGE_LIMIT}, order is asc or desc.",
                    code="invalid_value",
                    param=param,
                ),
            )
        return cls(limit=limit, order=order, after=query.get("after"))

    def page(self, items: Sequence[_T], listed: Callable[[_T], dict[str, Any]]) -> dict[str, Any]:
        """The page of `items` (oldest first), each written as `listed` gives it."""
        ordered = list(reversed(items)) if self.order == "desc" else list(items)
        if self.after is not None:
            ids = [item.id for item in ordered]
            ordered = ordered[ids.index(self.after) + 1 :] if self.after in ids else []
        data = [listed(item) for item in ordered[: self.limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None,
            "has_more": len(ordered) > self.limit,
        }
