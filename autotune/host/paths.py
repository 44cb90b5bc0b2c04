"""Where autotune keeps its files: `$AUTOTUNE_HOME` when set (tests point it at a temporary
directory), else the platform's user data and cache directories."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "AUTOTUNE_HOME"


def _home() -> Path | None:
    home = os.environ.get(HOME_ENV)
    return Path(home).expanduser() if home else None


def data_dir() -> Path:
    """autotune's own directory (the default database lives here)."""
    home = _home()
    if home is not None:
        return home
    import platformdirs  # only when needed: it is the fallback of a fallback

    return Path(platformdirs.user_data_dir("autotune"))


def cache_dir() -> Path:
    """Where cached answers (memory estimates) live: `$AUTOTUNE_HOME/cache`, else the user cache dir."""
    home = _home()
    if home is not None:
        return home / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("autotune"))
