"""Files written whole or not at all.

``tuned.json`` and ``model.json`` reach several MB (Restormer's tuned.json 8.6 MB), and other
processes read them while a tune runs: the paper scripts' packer gzips every tuned.json it
finds every 15 s, and two such copies of a file caught half-written were committed as
results.  The reference outputs cached by ``welder check`` and an export's inputs are read
by other processes too.  Writing beside the file and renaming over it (atomic on POSIX
within one filesystem) leaves a reader the old file or the new one, never a part.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def replaced(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A path beside ``path`` (with its suffix, which ``np.savez`` wants) to write in full;
    leaving the block renames it over ``path``, and an error leaves the old file and no
    partial one."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial{target.suffix}")
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def write_json(doc: Any, path: str | os.PathLike[str]) -> None:
    """``doc`` as indented JSON at ``path``, replacing what was there in one step."""
    with replaced(path) as partial, open(partial, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
