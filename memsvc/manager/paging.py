"""List RPCs' pages (ListWorkers, ListLeases): keys in order, at most a page at a time, the next page
named by an opaque token (the last key of this page, URL-safe base64)."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable

from memsvc.errors import InvalidArgument
from memsvc.runtime.limits import MAX_PAGE_SIZE

DEFAULT_PAGE_SIZE = 50


def page_of(
    keys: Iterable[str], page_size: int, page_token: str, check: Callable[[str], object] = str
) -> tuple[list[str], str]:
    """The page of ``keys`` (sorted) after ``page_token``, and the next page's token ("" on the last).
    ``check`` validates a decoded token's key (raising InvalidArgument or ValueError)."""
    if page_size < 0:
        raise InvalidArgument("page_size must not be negative", metadata={"field": "page_size"})
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    after = ""
    if page_token:
        try:
            after = base64.b64decode(page_token.encode(), altchars=b"-_", validate=True).decode()
            check(after)
        except (ValueError, UnicodeDecodeError, InvalidArgument):
            raise InvalidArgument(
                "bad page_token: pass next_page_token from a previous response", metadata={"field": "page_token"}
            ) from None
    ordered = sorted(k for k in keys if k > after)
    page = ordered[:size]
    token = base64.urlsafe_b64encode(page[-1].encode()).decode() if len(ordered) > size else ""
    return page, token


__all__ = ["DEFAULT_PAGE_SIZE", "page_of"]
