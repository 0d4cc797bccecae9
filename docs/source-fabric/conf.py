"""Sphinx configuration for the lightning-fsdp docs, in the style of Lightning's ``docs/source-fabric``.

Build with ``make docs`` (``sphinx-build -W --keep-going -b html docs/source-fabric docs/build/html``): every warning
is an error, in CI too. The build needs no network: intersphinx is off unless ``LIGHTNING_FSDP_DOCS_INTERSPHINX=1``.

Python code in the guide comes from ``examples/*.py`` through ``literalinclude``; the test suite runs every one of
those files (``tests/tests_fabric/test_docs_examples.py``), so the examples cannot rot.
"""

import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
# Document the code of this checkout, even where another copy of the package is installed.
sys.path.insert(0, str(_ROOT / "src"))

from lightning_fsdp.__about__ import __author__, __version__  # noqa: E402

project = "lightning-fsdp"
author = __author__
copyright = "The lightning-fsdp developers"
version = __version__
release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# core/: sections of Lightning's pages that tools/upstream_series.py inserts, not pages of their own
exclude_patterns = ["examples", "core", "_build", "Thumbs.db", ".DS_Store"]
# A bare ``::`` block is shown as plain text: Python belongs in ``examples/`` (executed by the tests) and is shown with
# ``.. literalinclude:: ../examples/<name>.py`` and ``:language: python``.
highlight_language = "text"

# -- autodoc and napoleon (Google-style docstrings, as in Lightning) ------------------------------------------------
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # types next to documented arguments, not a bare list
autodoc_typehints_format = "fully-qualified"  # "Bases: lightning.fabric.strategies.fsdp.FSDPStrategy"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- cross-references to Python, PyTorch and Lightning: offline by default -----------------------------------------
# Without intersphinx, references to ``torch`` and ``lightning`` objects render as code without links (no warning:
# ``nitpicky`` is off). Set LIGHTNING_FSDP_DOCS_INTERSPHINX=1 to link them where the network is reachable.
if os.environ.get("LIGHTNING_FSDP_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable/", None),
        "lightning": ("https://lightning.ai/docs/fabric/stable/", None),
    }

# -- HTML: the built-in theme, so the build needs nothing beyond Sphinx ---------------------------------------------
html_theme = "alabaster"
html_title = f"lightning-fsdp {version}"
html_theme_options = {
    "description": "Loading large checkpoints into FSDP models with Lightning Fabric",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}
html_show_sourcelink = True
