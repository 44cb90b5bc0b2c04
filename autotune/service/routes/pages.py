"""The page: the searches, one search live, and the plan form (server-rendered, no CDN)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["pages"], include_in_schema=False)
