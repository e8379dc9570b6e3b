"""Private JAX/Flax APIs are used in brainnx/_compat.py only."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'brainnx'
PUBLIC_FLAX_NNX = {'flax.nnx'}


def _private(module: str) -> bool:
  if module.startswith('jax._src') or module.startswith('jaxlib'):
    return True
  if module.startswith('flax.') and module not in PUBLIC_FLAX_NNX and module != 'flax':
    return True
  return False


def _imports(path: pathlib.Path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.module == 'flax.nnx' or node.module == 'jax':
        for alias in node.names:  # `from flax.nnx import graphlib` is private too
          yield f'{node.module}.{alias.name}' if alias.name.endswith('lib') or alias.name.startswith('_') else node.module
      else:
        yield node.module


@pytest.mark.parametrize('path', sorted(PACKAGE.glob('*.py')), ids=lambda p: p.name)
def test_no_private_imports_outside_compat(path):
  if path.name == '_compat.py':
    return
  private = [m for m in _imports(path) if _private(m)]
  assert not private, f'{path.name} imports private modules {private}; route them through _compat.py'
  text = path.read_text()
  assert 'jax._src' not in text and '._raw_value' not in text and '._trace_state' not in text


def test_compat_is_where_the_private_uses_are():
  private = [m for m in _imports(PACKAGE / '_compat.py') if _private(m)]
  assert private, 'the checker would not notice a private import'
