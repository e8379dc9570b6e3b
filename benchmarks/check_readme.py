"""Every figure README.md states is the cell of a stamped table that ``readme_figures.LEDGER``
names for it: that table, under that heading, in that row and column.

    python benchmarks/check_readme.py      # exit 1 and list every figure without its cell

A figure is a number (or a range) with a unit: a ratio, a share, a size or a time. The README's
figures, in order, must be the ledger's figures, in order: a figure added, removed or moved
without the ledger fails, and so does a ledger cell that holds anything but the figure (a swapped
pair, an edited value). Code blocks, code spans and link targets state no figure. Run by
tests/test_benchmarks.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import readme_figures  # noqa: E402
from _results import tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
_NUMBER = r'\d+(?:[.,]\d+)?'
# a measured figure: a number or a range with a unit (ratios, sizes, times, shares)
FIGURE = re.compile(rf'(?<![\w.]){_NUMBER}(?:\s?[–-]\s?{_NUMBER})?\s?(?:x|×|MB|MiB|GB|µs|us|ms|s|%|\sframes?)(?![\w])')
STAMP = re.compile(r'^commit: \S+ · date: .+ · jax \S+ · flax \S+ · .+ · statistic: .+$', re.M)


def normal(figure: str) -> str:
  return re.sub(r'\s', '', figure).replace('×', 'x').replace('-', '–').replace('us', 'µs')


def figures(text: str) -> list[str]:
  """The figures of ``text`` in order (repeats kept)."""
  text = re.sub(r'```.*?```', '', text, flags=re.S)  # code blocks state no measurement
  text = re.sub(r'`[^`]*`', '', text)  # nor do code spans (flags, file names, shapes)
  text = re.sub(r'\]\([^)]*\)', ']', text)  # nor do link targets
  return [m.group(0) for m in FIGURE.finditer(text)]


def cell(name: str, heading: str, row: str, column: str, nth: int = 1) -> str:
  """The cell (in the ``nth`` column of that name, where a header repeats one), or a
  ``LookupError`` saying what is missing."""
  path = RESULTS / name
  if not path.exists():
    raise LookupError(f'{name} does not exist')
  text = path.read_text()
  if not STAMP.search(text):
    raise LookupError(f'{name} has no stamp of the script that wrote it')
  for title, (header, *rows) in tables(text):
    if not title.startswith(heading) or column not in header:
      continue
    at = [k for k, h in enumerate(header) if h == column]
    for cells in rows:
      if cells and cells[0] == row and len(at) >= nth:
        return cells[at[nth - 1]]
  raise LookupError(f'{name} has no table under {heading!r} with a column {column!r} and a row {row!r}')


def holds(value: str, figure: str, column: str) -> bool:
  """Whether a table cell states ``figure``: the same text, either part of a ``time (ratio)``
  cell (``87 µs (1.22x)``), or its number in a column whose header names its unit
  (``µs (median)``, ``aliased (MB)``) or that holds shares."""
  value, figure = normal(value), normal(figure)
  if value == figure:
    return True
  pair = re.fullmatch(r'([^()]+)\(([^()]+)\)', value)
  if pair and figure in pair.groups():
    return True
  number, unit = re.fullmatch(rf'({_NUMBER}(?:–{_NUMBER})?)(.*)', figure).groups()
  header = normal(column)
  return value == number and (f'({unit})' in header or header.startswith(unit))


def problems(readme: str | None = None, ledger=None) -> list[str]:
  """What does not hold, one line each (empty: every figure is its cell)."""
  readme = (ROOT / 'README.md').read_text() if readme is None else readme
  ledger = readme_figures.LEDGER if ledger is None else ledger
  exempt = {normal(k) for k in readme_figures.NOT_MEASURED}
  stated = [f for f in figures(readme) if normal(f) not in exempt]
  found = []
  for k in range(max(len(stated), len(ledger))):
    said = stated[k] if k < len(stated) else None
    entry = ledger[k] if k < len(ledger) else None
    if entry is None:
      found.append(f'README figure {said!r} (number {k + 1}) has no ledger entry')
      continue
    if said is None or normal(said) != normal(entry[0]):
      found.append(f'README figure number {k + 1} is {said!r} but the ledger expects {entry[0]!r} there')
      break  # the rest is out of step
    try:
      value = cell(*entry[1:])
    except LookupError as e:
      found.append(f'{entry[0]!r}: {e}')
      continue
    if not holds(value, entry[0], entry[4]):
      found.append(f'{entry[0]!r}: {entry[1]} says {value!r} in row {entry[3]!r}, column {entry[4]!r}')
  return found


def main() -> int:
  found = problems()
  for line in found:
    print(line)
  print(f'{len(readme_figures.LEDGER)} figures in the ledger; {len(found)} problems')
  return 1 if found else 0


if __name__ == '__main__':
  sys.exit(main())
