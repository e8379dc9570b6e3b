"""Sphinx configuration for the brainnx documentation.

Build from the repository root (the source folder is the root, this folder holds
the configuration, so the site takes the pages from ``docs/`` and the notebooks
from the top-level ``notebooks/``)::

    python -m sphinx -W --keep-going -b html -c docs . docs/_build/html

then open ``docs/_build/html/index.html``. Notebooks are rendered from their
stored outputs (the test suite executes them, the doc build does not), and
everything the build writes stays inside its output folder.
"""

import importlib.metadata
from pathlib import Path

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
root_doc = 'docs/index'
# the source folder is the repository root: only these are pages
include_patterns = ['docs/*.md', 'docs/api/*.md', 'notebooks/*.ipynb']
exclude_patterns = ['docs/_build', '**.ipynb_checkpoints', 'Thumbs.db', '.DS_Store']

# MyST: `[text](page.md#heading)` links use GitHub-style heading anchors, so the
# same Markdown works on the code host and in the built site.
myst_heading_anchors = 4
myst_enable_extensions = ['colon_fence', 'dollarmath']

# Notebooks keep their outputs in the repository; the doc build only renders them.
nb_execution_mode = 'off'

html_theme = 'furo'
html_title = f'brainnx {release}'
html_static_path = []

_REDIRECT = '<!DOCTYPE html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url=docs/index.html">' \
            '<a href="docs/index.html">brainnx documentation</a>\n'


def _keep_notebook_files_inside_the_build(app):
  """myst-nb writes the notebooks' images next to the output folder (``<out>/../jupyter_execute``);
  put them in the build's doctree folder instead, which lies inside it."""
  app.env.mystnb_config = app.env.mystnb_config.copy(
    output_folder=str(Path(app.doctreedir) / 'jupyter_execute'),
    execution_cache_path=str(Path(app.doctreedir) / 'jupyter_cache'))


def _write_root_index(app, exception):
  """The pages live under ``docs/`` of the output: ``index.html`` at the top sends a reader there."""
  if exception is None and app.builder.format == 'html':
    Path(app.outdir, 'index.html').write_text(_REDIRECT)


def setup(app):
  app.connect('builder-inited', _keep_notebook_files_inside_the_build, priority=900)
  app.connect('build-finished', _write_root_index)
