"""The catalog's own errors, in the library's ``VitEmbedError`` hierarchy (stable ``code``, message for
people), so the command line prints them as one line with status 2."""

from __future__ import annotations

from vit_backbone.errors import VitEmbedError


class CatalogError(VitEmbedError):
    """A catalog folder that is missing, empty, inconsistent, or made with other options."""

    code = "invalid_catalog"


class SourceError(VitEmbedError):
    """A source folder or manifest that cannot be used (missing columns, duplicate ids, unknown format)."""

    code = "invalid_source"
