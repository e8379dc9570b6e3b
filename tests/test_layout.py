"""The test suite's own rules: every file listed in tests/README.md, every ``pytest.raises`` with
a ``match``, no unconditional skip, the forced device count of conftest.py, the declared
dependencies, and ruff's checks."""

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from conftest import DEVICES, forced_xla_flags

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
FILES = sorted(p.name for p in TESTS.glob('*.py'))


def _listed():
  """The file names in the first column of tests/README.md's file table."""
  names = set()
  for line in (TESTS / 'README.md').read_text().splitlines():
    if line.startswith('| `'):
      names.update(re.findall(r'`([\w]+\.py)`', line.split('|')[1]))
  return names


def test_readme_lists_every_test_file_and_no_other():
  listed = _listed()
  assert len(listed) >= 10, listed
  missing = sorted(set(FILES) - listed)
  absent = sorted(listed - set(FILES))
  assert not missing, f'tests/README.md does not list {missing}'
  assert not absent, f'tests/README.md lists {absent}, which do not exist'


def test_tests_named_in_the_readme_exist():
  """Each ``test_file::test_name`` in tests/README.md names a test function of that file."""
  refs = set(re.findall(r'`(test_\w+)::(test_\w+)`', (TESTS / 'README.md').read_text()))
  assert len(refs) >= 20, refs
  defined = {}
  for module, _ in refs:
    tree = ast.parse((TESTS / f'{module}.py').read_text())
    defined[module] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
  unknown = sorted(f'{m}::{t}' for m, t in refs if t not in defined[m])
  assert not unknown, f'tests/README.md names tests that do not exist: {unknown}'


def _calls(path, dotted):
  owner, name = dotted.split('.')
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
      value = node.func.value
      if isinstance(value, ast.Name) and value.id == owner or isinstance(value, ast.Attribute) and value.attr == owner:
        yield node


@pytest.mark.parametrize('name', [f for f in FILES if f.startswith('test_')])
def test_every_raises_has_a_match_and_no_skip_is_unconditional(name):
  path = TESTS / name
  bare = [c.lineno for c in _calls(path, 'pytest.raises') if not any(k.arg == 'match' for k in c.keywords)]
  assert not bare, f'{name}: pytest.raises without match= on lines {bare}'
  skips = [c.lineno for c in _calls(path, 'pytest.skip')] + [c.lineno for c in _calls(path, 'mark.skip')]
  assert not skips, f'{name}: unconditional skips on lines {skips}'
  for c in _calls(path, 'mark.skipif'):
    condition = c.args[0] if c.args else None
    assert not isinstance(condition, ast.Constant), f'{name}:{c.lineno}: skipif with a constant condition'


def test_the_checks_above_can_fail(tmp_path):
  probe = tmp_path / 'probe.py'
  probe.write_text('import pytest\nwith pytest.raises(ValueError):\n  pass\npytest.skip("x")\n')
  assert [c.lineno for c in _calls(probe, 'pytest.raises')] == [2]
  assert [c.lineno for c in _calls(probe, 'pytest.skip')] == [4]


@pytest.mark.parametrize('flags, expected', [
  ('', '--xla_force_host_platform_device_count=4'),
  ('--xla_force_host_platform_device_count=1', '--xla_force_host_platform_device_count=4'),
  ('--xla_cpu_foo=1 --xla_force_host_platform_device_count=8 --bar',
   '--xla_cpu_foo=1 --bar --xla_force_host_platform_device_count=4'),
])
def test_conftest_forces_the_device_count_whatever_xla_flags_holds(flags, expected):
  assert forced_xla_flags(flags, devices=4) == expected


def test_the_forced_device_count_took_effect():
  import jax

  assert len(jax.devices('cpu')) == DEVICES


def _third_party_imports(paths) -> set[str]:
  found = set()
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found |= {a.name.split('.')[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        found.add(node.module.split('.')[0])
  return {m for m in found if m not in sys.stdlib_module_names and m != 'brainnx'}


def _requirement_names(requirements) -> set[str]:
  return {re.split(r'[<>=\[ ;]', r)[0].replace('-', '_').split('_')[0] for r in requirements}


def test_the_package_imports_only_what_it_declares():
  """``pip install brainnx`` pulls what the transforms import and nothing else; the demo and the
  examples' extra imports are the ``demo`` extra's (matplotlib, for the plot, the ``plot``
  extra's, imported only when present)."""
  import tomllib

  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  package = ROOT / 'brainnx'
  core = [p for p in package.rglob('*.py') if p.name != 'demo.py' and 'examples' not in p.parts]
  declared = _requirement_names(project['dependencies'])
  assert _third_party_imports(core) == declared - {'jaxlib'}, (_third_party_imports(core), declared)
  extras = project['optional-dependencies']
  job = [package / 'demo.py', *(package / 'examples').glob('*.py')]
  allowed = declared | _requirement_names(extras['demo']) | _requirement_names(extras['plot'])
  assert _third_party_imports(job) <= allowed, _third_party_imports(job) - allowed


@pytest.mark.skipif(shutil.which('ruff') is None, reason='ruff is not installed (the dev extra installs it)')
def test_the_code_passes_ruff_with_the_projects_configuration():
  """``ruff check`` (configured in pyproject.toml: errors such as undefined or unused names, not
  style) passes on the package, the tests, the benchmarks and the docs' scripts."""
  docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'docs').glob('*.py'))
  done = subprocess.run([shutil.which('ruff'), 'check', '--no-cache', 'brainnx', 'tests', 'benchmarks', *docs],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr


# -- the package's own shape (the transform template) -----------------------------------------

PACKAGE = ROOT / 'brainnx'
MODULES = sorted(PACKAGE.rglob('*.py'))
PRIVATE = [p for p in MODULES if any(part.startswith('_') and part != '__init__.py' for part in p.relative_to(PACKAGE).parts)]


@pytest.mark.parametrize('path', MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_is_under_600_lines(path):
  lines = len(path.read_text().splitlines())
  assert lines < 600, f'{path.relative_to(ROOT)} has {lines} lines: split it along a seam'


def _offences(text: str, pattern: str) -> list[int]:
  return [k for k, line in enumerate(text.splitlines(), start=1) if re.search(pattern, line)]


def test_transforms_write_variables_through_the_engine_only():
  """A transform writes back through ``StatefulCall.write_back`` or ``LoopBody.write_back``."""
  found = {p.name: _offences(p.read_text(), r'\b(write_values|adopt_new)\(') for p in (PACKAGE / '_transforms').glob('*.py')}
  assert not any(found.values()), found


def test_no_configuration_is_unpacked_from_the_end_of_the_arguments():
  """A transform's settings travel in its Config, never as a tail of its positional arguments."""
  found = {str(p.relative_to(PACKAGE)): _offences(p.read_text(), r'= rest$|= args\[-') for p in MODULES}
  assert not any(found.values()), found


def _private_imports(path: pathlib.Path) -> list[str]:
  tree = ast.parse(path.read_text())
  return [
    f'{node.module}.{alias.name}'
    for node in ast.walk(tree)
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('brainnx')
    for alias in node.names
    if alias.name.startswith('_') and not alias.name.startswith('__')
    and node.module not in ('brainnx', 'brainnx._engine', 'brainnx._transforms')  # a module, not a name in one
  ]


@pytest.mark.parametrize('path', MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_private_name_from_another(path):
  """Names shared between files are public in the file that defines them (``_compat`` and the
  private packages are imported as modules, never their underscored names)."""
  assert not _private_imports(path), _private_imports(path)


@pytest.mark.parametrize('path', PRIVATE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_private_modules_have_no_all(path):
  """``__all__`` belongs to the public package (``brainnx/__init__.py``), whose reference it is."""
  assert not _offences(path.read_text(), r'^__all__\s*='), path


def test_the_checks_of_the_package_shape_can_fail(tmp_path):
  bad = tmp_path / 'bad.py'
  bad.write_text('from brainnx._engine.state import _helper\n__all__ = ["x"]\n*args, name = rest\n')
  assert _private_imports(bad) == ['brainnx._engine.state._helper']
  assert _offences(bad.read_text(), r'^__all__\s*=') == [2]
  assert _offences(bad.read_text(), r'= rest$|= args\[-') == [3]


def test_every_mutant_of_the_mutation_run_applies_once():
  """Each mutant's original text is found exactly once in its file (a refactor that moves or
  rewrites the line must move the mutant with it, or the run silently tests nothing)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location('mutation_run', TESTS / 'mutation' / 'run.py')
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  every = list(module.MUTANTS) + [m for m, _ in module.EQUIVALENT]  # an equivalent one's argument is about this code
  stale = [(m.name, m.file) for m in every if (ROOT / m.file).read_text().count(m.old) != 1]
  assert len(module.MUTANTS) >= 60 and not stale, stale


def _engine_rooms() -> list[str]:
  """The rooms the engine package's docstring lists, in its order."""
  import brainnx._engine as engine

  text = engine.__doc__.split('Rooms, each importing only those before it:')[1].split('Nothing here imports')[0]
  return re.findall(r'``(\w+)``', text)


def test_the_engine_rooms_import_only_the_rooms_listed_before_them():
  rooms = _engine_rooms()
  files = sorted(p.stem for p in (PACKAGE / '_engine').glob('*.py') if p.stem != '__init__')
  assert sorted(rooms) == files, 'the engine docstring must list every room once'
  for k, room in enumerate(rooms):
    tree = ast.parse((PACKAGE / '_engine' / f'{room}.py').read_text())
    used = {node.module.rsplit('.', 1)[-1] for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('brainnx._engine.')}
    later = sorted(used - set(rooms[:k]))
    assert not later, f'{room} imports {later}, listed after it'
    assert 'brainnx._transforms' not in (PACKAGE / '_engine' / f'{room}.py').read_text()
