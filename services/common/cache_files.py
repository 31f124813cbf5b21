"""Files flatwire derives from a model and keeps in the cache directory (--cache-dir) between starts."""

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Written whole or not at all: services starting together never read half a file. Raises OSError (a
    directory that cannot be written); the caller says what that costs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as out:
        try:
            out.write(data)
            out.close()
            os.replace(out.name, path)
        except OSError:
            Path(out.name).unlink(missing_ok=True)
            raise
