"""The documentation: the Sphinx site builds, links resolve, the reference covers the API.

The site is built from the repository root with ``docs/conf.py`` (pages from ``docs/``,
notebooks from ``notebooks/``), from the stored notebook outputs (``nb_execution_mode =
'off'``); the notebooks themselves are executed by test_notebooks.py.
"""

import importlib.metadata
import importlib.util
import inspect
import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import brainnx as bnx
from helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / 'docs'
NOTEBOOKS = sorted((ROOT / 'notebooks').glob('*.ipynb'))
PAGES = sorted(DOCS.rglob('*.md'))
API_PAGES = sorted((DOCS / 'api').glob('*.md'))
API = '\n'.join(p.read_text() for p in API_PAGES)


# -- the site -------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec('sphinx') is None, reason='needs sphinx (the dev extra)')
def test_sphinx_build_has_no_warnings(tmp_path):
  site = tmp_path / 'site'
  out = subprocess.run(
    [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-E', '-q', '-b', 'html', '-c', str(DOCS), str(ROOT), str(site)],
    capture_output=True, text=True, timeout=600, cwd=tmp_path,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  pages = [str(p.relative_to(ROOT).with_suffix('')) for p in PAGES] + [f'notebooks/{p.stem}' for p in NOTEBOOKS]
  assert {'docs/index', 'docs/comparison', 'docs/getting-started'} <= set(pages)
  for page in pages:
    assert (site / f'{page}.html').exists(), page
  assert 'docs/index.html' in (site / 'index.html').read_text()  # the top of the site leads to the pages
  index = (site / 'docs' / 'index.html').read_text()
  assert all(f'../notebooks/{p.stem}.html' in index for p in NOTEBOOKS), 'every notebook is linked from the index'
  # the notebooks' stored plots are in the site
  for name in ('02_ensembles_with_optax', '05_checkpointing'):
    assert '<img' in (site / 'notebooks' / f'{name}.html').read_text(), name
  # the build wrote nothing outside its output folder (myst-nb's jupyter_execute/ included)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['site']
  assert not (ROOT / 'jupyter_execute').exists() and not (DOCS / 'jupyter_execute').exists()


# -- links ----------------------------------------------------------------------------


def _markdown_sources():
  """(file, markdown text) for the READMEs, the doc pages and the notebooks' markdown cells."""
  yield ROOT / 'README.md', (ROOT / 'README.md').read_text()
  yield ROOT / 'tests' / 'README.md', (ROOT / 'tests' / 'README.md').read_text()
  yield ROOT / 'CONTRIBUTING.md', (ROOT / 'CONTRIBUTING.md').read_text()
  for page in PAGES:
    yield page, page.read_text()
  for nb in NOTEBOOKS:
    cells = json.loads(nb.read_text())['cells']
    yield nb, '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')


def _links(text: str) -> list[str]:
  text = re.sub(r'```.*?```', '', text, flags=re.S)  # code blocks hold no links
  text = re.sub(r'`[^`\n]*`', '', text)
  return re.findall(r'\]\(([^)\s]+)\)', text) + re.findall(r'(?:href|src)="([^"]+)"', text)


def _slug(heading: str) -> str:
  """GitHub's (and MyST's ``myst_heading_anchors``) anchor for a heading."""
  text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip()).lower()
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def _anchors(path: pathlib.Path) -> set[str]:
  text = re.sub(r'```.*?```', '', path.read_text(), flags=re.S)
  return {_slug(h) for h in re.findall(r'^#{1,6} +(.+?) *$', text, flags=re.M)}


@pytest.mark.parametrize('source,text', list(_markdown_sources()), ids=lambda x: getattr(x, 'name', ''))
def test_every_link_resolves_inside_the_repository(source, text):
  assert '../shared' not in text, f'{source} points outside the repository'
  for link in _links(text):
    if re.match(r'[a-z]+://', link) or link.startswith('mailto:'):
      continue  # external: not checked here (no network)
    target, _, anchor = link.partition('#')
    path = (source.parent / target).resolve() if target else source
    assert path.is_relative_to(ROOT), f'{source.name}: {link} leaves the repository'
    assert path.exists(), f'{source.name}: {link} does not exist'
    if anchor and path.suffix == '.md':
      assert anchor in _anchors(path), f'{source.name}: {link}: no heading #{anchor} in {path.name}'


def test_link_checker_catches_bad_links(tmp_path):
  assert _links('[a](x.md) `[b](y.md)` <img src="z.png">') == ['x.md', 'z.png']
  assert _slug('`vmap_new_states`') == 'vmap_new_states' and _slug('Run the demo') == 'run-the-demo'
  assert _slug('The rules every transform keeps') in _anchors(DOCS / 'api' / 'rules.md')


# -- the API reference ----------------------------------------------------------------


def _documented_signature(name: str) -> list[str]:
  """Parameter names in the reference's signature block for ``name``."""
  found = re.search(r'```py\n(?:class )?bnx\.' + re.escape(name) + r'\((.*?)\)\s*\n```', API, flags=re.S)
  assert found, f'docs/api/ has no signature block for {name}'
  params = []
  for part in found.group(1).replace('\n', ' ').split(','):
    part = part.strip().split('=')[0].strip().lstrip('*')
    if part:
      params.append(part)
  return params


@pytest.mark.parametrize('name', sorted(bnx.__all__))
def test_reference_documents_every_public_name_and_parameter(name):
  assert re.search(r'^#{2,3} `' + re.escape(name) + '`$', API, flags=re.M), f'no section for {name}'
  obj = getattr(bnx, name)
  if isinstance(obj, type) and issubclass(obj, Exception):
    return
  target = obj.__init__ if isinstance(obj, type) else obj
  actual = [p for p in inspect.signature(target).parameters if p != 'self']
  assert _documented_signature(name) == actual, f'docs/api/ documents {name} with other parameters'


def _python_blocks(text: str) -> list[str]:
  return re.findall(r'```python\n(.*?)```', text, flags=re.S)


def test_reference_examples_run_alone():
  blocks = _python_blocks(API)
  assert len(blocks) >= 10
  for block in blocks:
    exec(block, {})  # each one alone: its own imports and Variables


def test_getting_started_code_runs(capsys):
  namespace = {}
  for block in _python_blocks((DOCS / 'getting-started.md').read_text()):
    alone = {}
    exec(block, alone)  # each block alone: its own imports
    namespace.update(alone)
  assert int(namespace['optimizer'].step[...]) == 3 and int(namespace['counter'][...]) == 2
  assert capsys.readouterr().out.split()[-2:] == ['4', '1']


def test_comparison_blocks_run():
  setup, *blocks = _python_blocks((DOCS / 'comparison.md').read_text())
  assert 'class MLP' in setup and len(blocks) == 2
  for block in blocks:
    namespace = {}
    exec(setup, namespace)
    exec(block, namespace)
    assert namespace['loss'].shape == (8,) and len(set(map(float, namespace['loss']))) == 8


# -- notebooks and packaging ----------------------------------------------------------


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_stored_with_outputs(path):
  assert path.stat().st_size < 400_000, 'keep stored outputs small'
  cells = [c for c in json.loads(path.read_text())['cells'] if c['cell_type'] == 'code']
  assert cells and all(c['execution_count'] is not None for c in cells), 'execute the notebook before committing'
  counts = [c['execution_count'] for c in cells]
  assert counts == list(range(1, len(cells) + 1)), 'run top to bottom in a fresh kernel'
  outputs = [o for c in cells for o in c['outputs']]
  assert not [o for o in outputs if o['output_type'] == 'error']
  if path.stem in ('02_ensembles_with_optax', '05_checkpointing'):
    assert any('image/png' in o.get('data', {}) for o in outputs), 'the plot is stored'


def _installed() -> bool:
  try:
    return bool(importlib.metadata.version('brainnx'))
  except importlib.metadata.PackageNotFoundError:
    return False


@pytest.mark.skipif(not _installed(), reason='brainnx is on the path but not installed (pip install -e .)')
def test_version_and_metadata():
  meta = importlib.metadata.metadata('brainnx')
  assert bnx.__version__ == importlib.metadata.version('brainnx') == meta['Version']
  assert meta['Author'] or meta['Author-email']
  urls = dict(u.split(', ', 1) for u in meta.get_all('Project-URL'))
  assert {'Homepage', 'Documentation', 'Source'} <= set(urls)
  assert len(meta.get_all('Classifier')) >= 5


def test_dev_extra_installs_notebook_and_docs_tools():
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  dev = {re.split(r'[<>=\[ ]', d)[0].lower() for d in project['optional-dependencies']['dev']}
  assert {'pytest', 'nbclient', 'nbconvert', 'notebook', 'ipykernel', 'matplotlib', 'sphinx', 'myst-nb'} <= dev
  assert not any(d.startswith('matplotlib') for d in project['dependencies'])  # the demo runs without it


def test_nothing_in_the_repository_cites_a_document_outside_it():
  files = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  outside = re.compile(r'\bAPI\.md\b|\.\./shared|/work/|COMMON\.md')
  cited = []
  for name in files:
    path = ROOT / name
    if path.suffix not in ('.py', '.md', '.toml', '.ipynb', '.cfg', '.txt') or not path.exists():
      continue
    for k, line in enumerate(path.read_text(errors='replace').splitlines(), 1):
      if outside.search(line) and name != 'tests/test_docs.py':  # this file names the patterns
        cited.append(f'{name}:{k}: {line.strip()[:120]}')
  assert not cited, '\n'.join(cited)


def test_the_pages_quote_the_demos_own_defaults_and_run_its_many_device_command(tmp_path):
  """The demo is described by its --help: what the README says of its members, steps and
  checkpoint interval is the parser's, and no other page gives a default of its own."""

  from brainnx import demo

  defaults = {a.dest.replace('_', '-'): a.default for a in demo._parser()._actions if a.default is not None}
  readme = (ROOT / 'README.md').read_text()
  members = defaults['members']
  assert f"| (i) | {members} |" in readme and f"| (iv) | {members} |" in readme
  assert f"The {2 * members + 2} networks" in readme
  assert f"{defaults['steps']:,} adam steps" in readme
  for page in [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]:
    for flag, value in re.findall(r'`--([\w-]+)`[^`\n]{0,20}\(default ([^),]+)\)', page.read_text()):
      assert flag in defaults and value.strip() == str(defaults[flag]), (page.name, flag, value)


def test_the_readme_shows_what_the_demo_prints(capsys):
  """The README's block of the demo's output is what ``python -m brainnx.demo`` prints at its
  defaults (timings masked, numbers to 1e-3), and its figure is the four panels."""
  from brainnx import demo
  from notebook_outputs import mask, same_text

  readme = (ROOT / 'README.md').read_text()
  (quoted,) = re.findall(r'and prints:\n\n```text\n(.*?)```', readme, flags=re.S)
  demo.main(['--no-plot'])
  printed = capsys.readouterr().out.strip()
  assert same_text(mask(quoted.strip()), mask(printed)), f'README:\n{quoted}\nprinted:\n{printed}'
  assert '](docs/images/demo_figure1.png)' in readme


CODE_WIDTH = 88  # what a code block shows without scrolling on the docs site at 1280 px


def _code_lines(markdown: str):
  for block in re.finditer(r'^```[^\n]*\n(.*?)^```', markdown, flags=re.S | re.M):
    first = markdown[:block.start(1)].count('\n') + 1
    for k, line in enumerate(block.group(1).splitlines()):
      yield first + k, line


def test_code_lines_fit_the_page():
  """Code in the README, the docs and the notebooks (code cells, and code blocks in their text)
  is at most 88 characters a line."""
  wide = []
  for page in [ROOT / 'README.md', ROOT / 'CONTRIBUTING.md', *sorted(DOCS.rglob('*.md'))]:
    wide += [f'{page.relative_to(ROOT)}:{n}' for n, line in _code_lines(page.read_text())
             if len(line) > CODE_WIDTH]
  for path in NOTEBOOKS:
    for k, cell in enumerate(json.loads(path.read_text())['cells']):
      source = ''.join(cell['source'])
      lines = source.splitlines() if cell['cell_type'] == 'code' else [text for _, text in _code_lines(source)]
      wide += [f'{path.name} cell {k}' for line in lines if len(line) > CODE_WIDTH]
  assert not wide, wide


def _browser():
  import shutil

  try:
    import playwright  # noqa: F401
  except ImportError:
    return None
  return shutil.which('chromium') or shutil.which('chromium-browser') or shutil.which('google-chrome')


@pytest.mark.skipif(_browser() is None, reason='needs Chromium and playwright (docs/check_overflow.py)')
def test_no_code_block_or_output_scrolls_sideways_at_1280_px(tmp_path):
  """The built site in headless Chromium at 1280 px: no code block, notebook output or page is
  wider than its box (docs/check_overflow.py, which also runs on its own)."""
  sys.path.insert(0, str(DOCS))
  import check_overflow

  check_overflow.build_site(tmp_path / 'site')
  found = check_overflow.overflowing(tmp_path / 'site', _browser(), 1280, include_outputs=True)
  assert not found, found


def _demo_commands():
  """Every ``python -m brainnx.demo`` command line of a bash block in the README and the docs
  (with its environment assignments), but the many-host ones (tests/test_distributed.py runs
  those on 127.0.0.1)."""
  found = []
  for page in [ROOT / 'README.md', *sorted(DOCS.rglob('*.md'))]:
    for block in re.findall(r'^```bash\n(.*?)^```', page.read_text(), flags=re.S | re.M):
      for line in block.splitlines():
        command = line.split('#')[0].split('&&')[-1].strip()
        if 'python -m brainnx.demo' in command and '--distributed' not in command:
          found.append(pytest.param(command, id=f'{page.name}: {command}'))
  return found


@pytest.mark.parametrize('command', _demo_commands())
def test_every_demo_command_on_the_pages_runs_as_written(command, tmp_path):
  import shlex

  words = shlex.split(command)
  env = child_env()
  while '=' in words[0]:  # XLA_FLAGS=... before the command
    name, _, value = words.pop(0).partition('=')
    env[name] = value
  assert words[:3] == ['python', '-m', 'brainnx.demo'], command
  out = subprocess.run([sys.executable, *words[1:]], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  if '--help' in words:
    assert out.stdout.startswith('usage: python -m brainnx.demo')
    return
  assert 'trained 12 networks (the four panels of Figure 1)' in out.stdout
  if '--devices' in words:
    assert f'on {words[words.index("--devices") + 1]} device(s) in 1 process(es)' in out.stdout
  written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*.*'))
  if '--no-plot' in words:
    assert written == []
  elif '--out' in words:
    target = words[words.index('--out') + 1]
    assert written == [target if target.endswith('.png') else target.rstrip('/') + '/ensemble.png']
  else:
    assert written == ['ensemble.png']


def test_the_contributor_guide_names_what_exists():
  """Every file path and every engine name CONTRIBUTING.md's walk-through uses is there."""
  from brainnx._engine import call, eager, errors, loop_body
  from brainnx._transforms import remat

  text = (ROOT / 'CONTRIBUTING.md').read_text()
  paths = set(re.findall(r'`((?:brainnx|tests|benchmarks|docs|\.ci)/[\w./<>-]+)`', text))
  missing = [p for p in paths if '<' not in p and not (ROOT / p.rstrip('/')).exists()]
  assert not missing, missing
  assert {'brainnx/_transforms/remat.py', 'tests/test_conformance.py', 'docs/api/rules.md'} <= paths
  source = inspect.getsource(remat)
  for name in ('RematConfig(Config)', 'check_callable', 'normalize_argnums', 'call(_remat_impl, config, (fun,), args',
               'StatefulCall.enter', 'stateful.rolling_back()', 'stateful.pure', 'stateful.write_back(',
               'stateful.output(', 'name=config.name'):
    assert name in source, name
  for name in ('RematConfig(Config)', 'eager.call(impl, config, roots, args, kwargs', 'impl(config, roots, *args',
               'eager.program', 'StatefulCall.enter', 'stateful.rolling_back()', 'stateful.write_back(',
               'LoopBody.write_back', "`CONFIGS`"):
    assert name in text, name
  assert callable(eager.call) and callable(eager.program) and callable(errors.check_callable)
  assert callable(call.StatefulCall.enter) and callable(loop_body.LoopBody.write_back)
  conformance = (ROOT / 'tests' / 'test_conformance.py').read_text()
  for table in ('TRANSFORMS = {', 'DIRECT = {', 'CONFIGS = {', 'RETURNS_OUTPUT = ['):
    assert table in conformance, table
  lines = len((ROOT / 'brainnx' / '_transforms' / 'remat.py').read_text().splitlines())
  assert f'{lines} lines' in text, f'remat.py has {lines} lines'
