"""Private JAX/Flax APIs are used in the brainnx/_compat package only, and that package imports
nothing else of brainnx."""

import ast
import os
import pathlib
import subprocess
import sys

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


COMPAT = PACKAGE / '_compat'
ROOMS = sorted(COMPAT.glob('*.py'))
OTHERS = sorted(p for p in PACKAGE.rglob('*.py') if COMPAT not in p.parents)


@pytest.mark.parametrize('path', OTHERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_imports_outside_compat(path):
  private = [m for m in _imports(path) if _private(m)]
  assert not private, f'{path.name} imports private modules {private}; route them through brainnx._compat'
  text = path.read_text()
  for private in PRIVATE_USES:
    assert private not in text, f'{path.name} uses {private!r}; route it through brainnx._compat'


# Private attributes and internal conventions of jax and flax that only the _compat package may touch.
PRIVATE_USES = (
  'jax._src', '._raw_value', '._trace_state', '_pytree__', '._replace(', 'debug_info._',
  '.__dict__', '_can_update', 'trace_ctx', ' type(jnp.', '(type(jnp.', 'ArrayImpl)',
)


def _vars_calls(path):
  return [
    node.lineno
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'vars'
  ]


@pytest.mark.parametrize('path', OTHERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_attribute_dicts_are_reached_through_compat(path):
  """``vars(node)`` (whose writes bypass flax's checks) is called in the _compat package only."""
  calls = _vars_calls(path)
  assert not calls, f'{path.name} calls vars() on lines {calls}; use _compat.attributes'


def test_importing_brainnx_starts_no_jax_backend():
  """``import brainnx`` must not initialise a JAX backend (which costs time and claims devices)."""
  code = (
    'import brainnx, jax._src.xla_bridge as xb, sys; '
    'sys.exit(1 if xb._backends else 0)'
  )
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  result = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, f'import brainnx started a JAX backend\n{result.stderr}'


def test_compat_is_where_the_private_uses_are(tmp_path):
  """The checkers find what they look for in the _compat package, so an empty result elsewhere
  means something."""
  assert len(OTHERS) >= 20, OTHERS  # the engine and transform modules are all checked
  private = [m for room in ROOMS for m in _imports(room) if _private(m)]
  assert private, 'the checker would not notice a private import'
  text = ''.join(room.read_text() for room in ROOMS)
  assert [use for use in PRIVATE_USES if use in text], 'no private use in _compat: the text check is vacuous'
  probe = tmp_path / 'probe.py'
  probe.write_text('from flax.nnx import graphlib\nimport jax._src.core\nd = vars(object)\n')
  assert _vars_calls(probe) == [3], 'the vars() check would not notice a call'
  assert sorted(m for m in _imports(probe) if _private(m)) == ['flax.nnx.graphlib', 'jax._src.core']


@pytest.mark.parametrize('room', ROOMS, ids=lambda p: p.name)
def test_compat_imports_nothing_else_of_brainnx(room):
  """The version boundary sits below everything: a room imports other rooms, never the engine
  or the transforms."""
  upward = [m for m in _imports(room) if m.startswith('brainnx') and not m.startswith('brainnx._compat')]
  assert not upward, f'{room.name} imports {upward}'


def test_the_reference_names_every_flax_method_brainnx_wraps():
  """docs/api/rules.md says, in one place, what importing brainnx changes in flax: every wrapped
  method is named there, and the wrappers leave flax's behaviour as flax's own method has it."""
  import jax.numpy as jnp
  from flax import nnx

  from brainnx._compat import flax_hooks

  rules = (PACKAGE.parent / 'docs' / 'api' / 'rules.md').read_text()
  section = rules[rules.index('## What importing brainnx changes in flax'):]
  named = {name for owner, name, _, _ in flax_hooks.INSTALLED if isinstance(name, str)}
  missing = sorted(name for name in named if f'`{name}`' not in section and f'{name}`' not in section)
  assert not missing, f'wrapped but not in the reference: {missing}'
  # the same program with the wrappers taken out and put back gives the same values
  results = []
  for on in (False, True):
    flax_hooks.use_hooks(on)
    try:
      model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      model.kernel[...] = model.kernel[...] * 2
      nnx.update(model, nnx.state(nnx.merge(*nnx.split(model))))
      results.append((model.kernel[...], model.bias[...]))
    finally:
      flax_hooks.use_hooks(True)
  for a, b in zip(*results):
    assert jnp.array_equal(a, b)
