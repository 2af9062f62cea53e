"""Sphinx configuration of memshare's manual (``sphinx-build -W -b html docs <out>``).

The build needs no network: no intersphinx, no downloaded theme assets.
"""

from __future__ import annotations

import os
import sys

# The sources, for a build from a clone where memshare is not installed (CI installs it: ``.[docs]``).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src")))

import memshare  # noqa: E402

project = "memshare"
author = "memshare's authors"
copyright = "memshare's authors"
release = version = memshare.__version__

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: ::: fences for directives, headings get anchors for links within the manual.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# numpydoc renders the sections; the members of a class are listed by autodoc (:members:), not
# by numpydoc's autosummary tables, which would need stub pages for inherited Pool methods.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the Parameters sections say the types, in words

html_theme = "pydata_sphinx_theme"
html_title = f"memshare {release}"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
# Every page is a top-level page of the header's navigation bar, so the left sidebar would stay empty: no sidebar.
html_sidebars = {"**": []}

# Every documented function and class says what each of its parameters is, and no parameter it does not have.
numpydoc_validation_checks = {"PR01", "PR02"}
# Broadcast is made by memshare.broadcast(), never by hand: its constructor's arguments are memshare's own.
numpydoc_validation_exclude = {r"^memshare\.Broadcast$"}
