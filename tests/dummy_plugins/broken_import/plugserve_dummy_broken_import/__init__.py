"""A test plugin that cannot be imported: its (pretend) dependency is missing."""

from __future__ import annotations

raise ImportError("plugserve_dummy_broken_import needs the package 'not_installed_anywhere'")
