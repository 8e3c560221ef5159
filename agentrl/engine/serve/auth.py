"""`agentrl serve`'s admin routes: which paths the admin key opens (SGLang 0.5.23's
`AuthLevel.ADMIN_OPTIONAL`). The key and body checks themselves are `agentrl.http_guard`'s."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter
from fastapi.routing import APIRoute

from agentrl.http_guard import GuardMiddleware, is_allowed

__all__ = ["ADMIN", "GuardMiddleware", "admin_paths", "is_allowed"]

ADMIN = "admin"
"""The tag of the routes SGLang marks `AuthLevel.ADMIN_OPTIONAL` (its weight, memory and cache
routes): with an admin key set, only that key opens them."""


def admin_paths(routers: Iterable[APIRouter]) -> frozenset[str]:
    """The paths of the routes tagged `ADMIN` (every route of `agentrl serve` has a fixed path,
    so the path alone tells the middleware which key opens it)."""
    return frozenset(
        route.path
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and ADMIN in route.tags
    )
