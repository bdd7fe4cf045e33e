"""Reading an operator's TOML file: what cannot be read or parsed is one line naming the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def read_toml(path: Path, error: type[ValueError]) -> dict[str, Any]:
    """The file's tables; `error` (the caller's one-line error type) if it cannot be read or is not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path} is not TOML: {exc}") from None
