"""Reading what the server logs: a JSON-lines file, one dict per line."""

from __future__ import annotations

import json
from pathlib import Path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
