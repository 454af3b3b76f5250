"""Sphinx configuration for torchrl-asyncpool."""

import os
import sys
from importlib import metadata

sys.path.insert(0, os.path.abspath("../.."))

project = "torchrl-asyncpool"
author = "torchrl-asyncpool contributors"
copyright = "torchrl-asyncpool contributors"

try:
    release = metadata.version("torchrl-asyncpool")
except metadata.PackageNotFoundError:
    release = "0.1.0"
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.intersphinx",
]

# No network access when building: no inventories are fetched.
intersphinx_mapping = {}

napoleon_google_docstring = True
napoleon_numpy_docstring = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"

nitpicky = False

exclude_patterns = ["_build", "build", "Thumbs.db", ".DS_Store"]
templates_path = []

html_theme = "alabaster"
html_static_path = []
