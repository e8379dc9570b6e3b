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

from conftest import forced_xla_flags

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
  assert forced_xla_flags(flags) == expected


def test_the_forced_device_count_took_effect():
  import jax

  assert jax.local_device_count() == 4


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
