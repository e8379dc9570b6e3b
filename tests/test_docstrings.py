"""Every docstring example in brainnx runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import brainnx

MODULES = sorted(
  name for _, name, _ in pkgutil.iter_modules(brainnx.__path__, 'brainnx.') if name != 'brainnx.demo'
)


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0


def test_every_public_name_has_an_example():
  missing = [
    name
    for name in brainnx.__all__
    if '>>>' not in (getattr(brainnx, name).__doc__ or '') and name != 'BatchAxisError'
  ]
  assert not missing, f'public names without a docstring example: {missing}'
