"""Sphinx configuration for the brainnx documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` from the
repository root. Notebooks are rendered from their stored outputs (they are
executed by the test suite, not by the doc build).
"""

import importlib.metadata

project = 'brainnx'
author = 'brainnx maintainers'
copyright = '2026, brainnx maintainers'
try:
  release = importlib.metadata.version('brainnx')
except importlib.metadata.PackageNotFoundError:  # building from a checkout that is not installed
  release = 'unknown'
version = release

extensions = ['myst_nb']

source_suffix = {'.md': 'myst-nb', '.ipynb': 'myst-nb'}
root_doc = 'index'
exclude_patterns = ['_build', '**.ipynb_checkpoints', 'Thumbs.db', '.DS_Store']

# MyST: `[text](page.md#heading)` links use GitHub-style heading anchors, so the
# same Markdown works on the code host and in the built site.
myst_heading_anchors = 4
myst_enable_extensions = ['colon_fence', 'dollarmath']

# Notebooks keep their outputs in the repository; the doc build only renders them.
nb_execution_mode = 'off'

html_theme = 'furo'
html_title = f'brainnx {release}'
html_static_path = []
