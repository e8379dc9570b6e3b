"""Every docstring example in brainnx runs and prints what it says."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import brainnx

MODULES = sorted(
  name for _, name, _ in pkgutil.walk_packages(brainnx.__path__, 'brainnx.') if name != 'brainnx.demo'
)
# the modules that define a public name: each has examples to run (others may have none)
DEFINING = sorted({getattr(brainnx, n).__module__ for n in brainnx.__all__} & set(MODULES))


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
  if name in DEFINING:
    assert result.attempted > 0, f'{name} defines public names but has no example to run'


def test_the_examples_cover_the_public_modules():
  assert len(DEFINING) >= 5, DEFINING  # the package's public names come from its _transforms and _engine modules


def test_every_public_name_has_an_example():
  missing = [
    name
    for name in brainnx.__all__
    if '>>>' not in (getattr(brainnx, name).__doc__ or '')
  ]
  assert not missing, f'public names without a docstring example: {missing}'


STATEFUL_FUNCTION_METHODS = (
  'make_jaxpr', 'get_jaxpr', 'get_states', 'get_read_states', 'get_write_states', 'get_out_shapes',
  'jaxpr_call', '__call__', 'clear_cache', 'get_cache_stats',
)
PUBLIC = [(name, getattr(brainnx, name)) for name in brainnx.__all__] + [
  (f'StatefulFunction.{m}', getattr(brainnx.StatefulFunction, m)) for m in STATEFUL_FUNCTION_METHODS
]


@pytest.mark.parametrize('label, obj', PUBLIC, ids=[label for label, _ in PUBLIC])
def test_public_docstring_format(label, obj):
  """Google style: a summary line, ``Args:`` (when there are parameters), ``Returns:`` (functions),
  ``Example``; every function, method and ``__init__`` annotates its return type."""
  doc = inspect.getdoc(obj) or ''
  problems = []
  if not doc or not doc.splitlines()[0].strip():
    problems.append('no one-line summary')
  if inspect.isclass(obj):
    init = obj.__dict__.get('__init__')  # an exception inheriting its __init__ has no parameters of its own
    func = init
  else:
    func = obj
  if func is not None:
    signature = inspect.signature(func)
    params = [p for p in signature.parameters if p != 'self']
    if params and 'Args:' not in doc:
      problems.append(f"no 'Args:' section for parameters {params}")
    if signature.return_annotation is inspect.Signature.empty:
      problems.append('no return annotation' + (' on __init__' if inspect.isclass(obj) else ''))
  if not inspect.isclass(obj) and 'Returns:' not in doc:
    problems.append("no 'Returns:' section")
  if 'Example' not in doc:
    problems.append('no Example section')
  assert not problems, f'{label}: ' + '; '.join(problems)
