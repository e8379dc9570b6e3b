"""Every figure README.md states in "What you get" and "Benchmarks" is in a stamped table under
benchmarks/results/ (a file that starts with the stamp of the script that measured it).

    python benchmarks/check_readme.py      # exit 1 and list the figures without a source

Run by tests/test_benchmarks.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
SECTIONS = ('What you get', 'Benchmarks')
_NUMBER = r'\d+(?:[.,]\d+)?'
# a measured figure: a number or a range with a unit (ratios, sizes, times, shares)
FIGURE = re.compile(rf'(?<![\w.]){_NUMBER}(?:\s?[–-]\s?{_NUMBER})?\s?(?:x|×|MB|MiB|GB|µs|us|ms|s|%)(?![\w])')
STAMP = re.compile(r'^commit: \S+ · date: .+ · jax \S+ · flax \S+ · .+ · statistic: .+$', re.M)


def sections(readme: str) -> str:
  """The text of the README sections whose figures need a source."""
  parts = re.split(r'^## ', readme, flags=re.M)
  return '\n'.join(p for p in parts if p.split('\n', 1)[0].strip() in SECTIONS)


def normal(figure: str) -> str:
  return re.sub(r'\s', '', figure).replace('×', 'x').replace('-', '–').replace('us', 'µs')


def figures(text: str) -> list[str]:
  text = re.sub(r'`[^`]*`', '', text)  # code (flags, file names, shapes) states no measurement
  text = re.sub(r'\]\([^)]*\)', ']', text)  # nor do link targets
  return sorted({m.group(0) for m in FIGURE.finditer(text)})


def tables() -> dict[Path, str]:
  """Stamped result files and their normalised text; unstamped ones do not count."""
  found = {}
  for path in sorted(RESULTS.glob('*.md')):
    text = path.read_text()
    if STAMP.search(text):
      found[path] = normal(text)
  return found


def found_in(figure: str, table: str) -> bool:
  """The figure as written, or its number in a table whose header names its unit (``(MB)``, or a
  column headed ``µs (median)``)."""
  figure = normal(figure)
  if figure in table:
    return True
  number, unit = re.fullmatch(rf'({_NUMBER}(?:–{_NUMBER})?)(.*)', figure).groups()
  return (f'({unit})' in table or f'|{unit}(' in table) and re.search(rf'(?<![\d.]){re.escape(number)}(?![\d])', table) is not None


def missing(readme: str | None = None) -> list[str]:
  readme = (ROOT / 'README.md').read_text() if readme is None else readme
  sources = tables()
  return [f for f in figures(sections(readme)) if not any(found_in(f, t) for t in sources.values())]


def main() -> int:
  lost = missing()
  for figure in lost:
    print(f'README figure {figure!r} is in no stamped table under benchmarks/results/')
  print(f'{len(figures(sections((ROOT / "README.md").read_text())))} figures, {len(tables())} stamped tables, '
        f'{len(lost)} without a source')
  return 1 if lost else 0


if __name__ == '__main__':
  sys.exit(main())
