"""The service's own JSON records: one file per key in a 0700 folder of its state folder, each
replaced whole (written aside, then renamed), so a reader never sees half a record and a
restarted service finds what it last wrote. Meters and served endpoints keep theirs here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Records:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: object) -> Path:
        return self.folder / f"{key}.json"

    def write(self, key: object, data: dict[str, Any]) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path(key).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path(key))

    def read(self, key: object) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path(key).read_text())
        except (FileNotFoundError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.json")) if self.folder.is_dir() else []
