"""Every figure in README.md's "What you get" and "Benchmarks" sections is in a stamped table
under benchmarks/results/ (benchmarks/check_readme.py), and the check can fail."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('check_readme', ROOT / 'benchmarks' / 'check_readme.py')
check_readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_readme)


def test_every_readme_figure_is_in_a_stamped_table():
  lost = check_readme.missing()
  assert not lost, f'README figures with no stamped table under benchmarks/results/: {lost}'


def test_the_check_finds_figures_and_flags_an_unsourced_one():
  readme = '## Benchmarks\n\nbrainnx is 123.45x raw `jax.jit(--x 3x)` and 7.5–8.5 µs per call.\n## Other\n9x\n'
  assert check_readme.figures(check_readme.sections(readme)) == ['123.45x', '7.5–8.5 µs']
  assert check_readme.missing(readme) == ['123.45x', '7.5–8.5 µs']
