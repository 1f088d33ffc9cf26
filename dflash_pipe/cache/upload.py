"""One object written as a stream: visible under its name only once complete (object stores have no rename)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .object_fs import ObjectCacheFS

log = logging.getLogger("dflash_pipe.cache.fs")


class Upload:
    """A write-only stream onto one object; visible only after `commit`. `abort` never leaves data
    under the name: bytes written after it are dropped, the stream is closed and the object removed."""

    def __init__(self, fs: ObjectCacheFS, name: str):
        self.fs, self.name = fs, name
        self._out = fs.fs.open_output_stream(fs.key(name))
        self.dropped = False

    def write(self, data) -> None:
        if not self.dropped:
            self._out.write(data)

    def commit(self) -> None:
        self._out.close()  # CompleteMultipartUpload (or the single PUT of a small object)

    def abort(self) -> None:
        self.dropped = True
        try:
            self._out.close()
        except Exception:  # noqa: BLE001 - a failed upload that did not complete is what we want
            pass
        try:
            self.fs.fs.delete_file(self.fs.key(self.name))
        except Exception:  # noqa: BLE001 - nothing was created; or a rerun redoes it (no sidecar)
            log.warning("could not delete the aborted upload %s (harmless: it has no sidecar)",
                        self.fs.display(self.name))
