"""The export's own option error, shared by api.py and drafts.py."""

from __future__ import annotations

from ortspec.runtime.errors import ExportError, InvalidOptionError


class ExportOptionError(ExportError, InvalidOptionError):
    """An export option is out of range (also a ValueError)."""
