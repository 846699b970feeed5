"""The DiT file rank 0's weights came from, as every worker checks it: the same bytes or no pool.

A worker loads the DiT from "the same path" as rank 0, on this server or another; a file
replaced there since rank 0 loaded it (or another file at that path on another server) would
give a wrong result without an error. Rank 0 names the file and its identity (a sampled digest
of bounded cost: weights/file_identity.py says what it reads and what it can miss) in the build
message; each worker checks its own file before it builds and reports a mismatch in its status,
which fails the pool's start naming the file, the rank and its server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from comfy.multidevice.weights.file_identity import check_same_file, file_identity, FileIdentity


class DitFileError(ValueError):
    """A build message's DiT file that does not parse; the message names what was wrong."""


@dataclass(frozen=True)
class DitFile:
    path: str
    identity: FileIdentity

    @classmethod
    def of_recipe(cls, recipe) -> "DitFile | None":
        """The file a recipe's `path` names, as it is now (None: the recipe names no file)."""
        path = recipe.kwargs.get("path") if isinstance(recipe.kwargs, dict) else None
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            return None
        return cls(os.fspath(path), file_identity(path))

    def to_data(self) -> dict:
        return {"path": self.path, "identity": self.identity.to_data()}

    @classmethod
    def from_data(cls, data) -> "DitFile":
        if not isinstance(data, dict) or not isinstance(data.get("path"), str):
            raise DitFileError(f"the build message names no DiT file path ({type(data).__name__})")
        return cls(data["path"], FileIdentity.from_data(data.get("identity")))

    def check(self, where: str) -> None:
        """Raise FileMismatchError naming the file and `where` unless this server's file is rank 0's."""
        check_same_file(self.path, self.identity, where)
