"""Every figure in README.md is the cell of a stamped table under benchmarks/results/ that the
ledger (benchmarks/readme_figures.py) names for it (benchmarks/check_readme.py), and the check
fails on a swapped, edited, orphaned or unsourced figure."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / 'benchmarks' / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


check_readme = _load('check_readme')
LEDGER = check_readme.readme_figures.LEDGER
README = (ROOT / 'README.md').read_text()


def test_every_readme_figure_is_the_cell_its_ledger_entry_names():
  found = check_readme.problems()
  assert not found, '\n'.join(found)


def test_figures_are_read_in_order_outside_code():
  text = 'It took 123.45x and 7.5–8.5 µs `--x 3x` [a](b_2x.md)\n```\n9 ms\n```\nthen 9 ms.'
  assert check_readme.figures(text) == ['123.45x', '7.5–8.5 µs', '9 ms']


def test_two_swapped_figures_fail():
  # two neighbouring figures of the ledger, each stated once: their places swapped
  a, b = next((a[0], b[0]) for a, b in zip(LEDGER, LEDGER[1:]) if a[0] != b[0] and README.count(a[0]) == README.count(b[0]) == 1)
  swapped = README.replace(a, 'TMP').replace(b, a).replace('TMP', b)
  assert swapped != README
  assert any('ledger expects' in p for p in check_readme.problems(swapped))


def test_an_edited_figure_fails():
  edited = README.replace('1.8%', '7.1%', 1)
  assert any("'1.8%'" in p for p in check_readme.problems(edited))


def test_a_figure_with_no_ledger_entry_fails():
  added = README.replace('## Learn more', 'It is 12.5x faster.\n\n## Learn more', 1)
  assert any('12.5x' in p for p in check_readme.problems(added))


def test_a_ledger_cell_holding_another_value_fails():
  index = next(k for k, e in enumerate(LEDGER) if e[0] == '96.0 MB')
  wrong = list(LEDGER)
  wrong[index] = ('96.0 MB', 'donation.md', 'Donated training step', 'pure jax.jit', 'aliased (MB)')  # holds 0.0
  assert any("donation.md says '0.0'" in p for p in check_readme.problems(ledger=wrong))


def test_a_figure_removed_from_its_table_fails():
  index = next(k for k, e in enumerate(LEDGER) if e[0] == '3.3 MB')
  gone = list(LEDGER)
  gone[index] = ('3.3 MB', 'checkpoint_memory.md', 'tanh RNN', 'a row that is not there', 'XLA temp (MB)')
  assert any('has no table' in p for p in check_readme.problems(ledger=gone))
