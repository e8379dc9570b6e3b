"""Run the notebooks and keep their stored outputs honest.

``python tests/notebook_outputs.py [NAME ...]`` re-executes notebooks (all of them by default) in
a fresh kernel and stores their outputs tidied: consecutive stream outputs merged into one and
carriage returns resolved, so a progress bar is stored as the text of its last state, one block
per stream. ``tests/test_notebooks.py`` executes each notebook the same way and compares what it
prints with what is stored (``differences``); a stale stored output fails the suite.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / 'notebooks'
TIMEOUT_S = 600

# what changes between two runs of the same code: timings, rates, addresses
_VOLATILE = [
  (re.compile(r'\[\d\d:\d\d(?::\d\d)?<[^\]]*\]'), '[elapsed]'),  # tqdm's [00:01<00:02, 38.0it/s]
  (re.compile(r'\d+(?:\.\d+)?\s?(?:it/s|s/it)'), '<rate>'),
  (re.compile(r' *\b\d+(?:\.\d+)?\s?(?:s|ms|µs|us)\b'), ' <time>'),  # with its padding: a column of times
  (re.compile(r'0x[0-9a-fA-F]+'), '0x…'),
]
_NUMBER = re.compile(r'[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?')


def tidy_stream(text: str) -> str:
  """A terminal's view of ``text``: on each line, what follows the last carriage return."""
  lines = text.split('\n')
  return '\n'.join(line.rstrip('\r').rsplit('\r', 1)[-1] for line in lines)


def tidy(nb) -> bool:
  """Merge consecutive stream outputs of a cell (per stream), resolve carriage returns and drop
  blank streams, in place. Returns whether anything changed."""
  changed = False
  for cell in nb.cells:
    if cell.cell_type != 'code':
      continue
    merged = []
    for out in cell.outputs:
      if out.output_type == 'stream' and merged and merged[-1].output_type == 'stream' \
          and merged[-1].name == out.name:
        merged[-1].text += out.text
        changed = True
      else:
        merged.append(out)
    for out in merged:
      if out.output_type == 'stream':
        clean = tidy_stream(out.text)
        changed |= clean != out.text
        out.text = clean
    # a stream left blank (the newline a progress bar writes when it closes) is an empty box
    kept = [out for out in merged if out.output_type != 'stream' or out.text.strip()]
    changed |= len(kept) != len(merged)
    cell.outputs = kept
  return changed


def execute(path: Path):
  """``path`` run top to bottom in a fresh kernel from its own folder, its outputs tidied."""
  import nbclient
  import nbformat

  nb = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name='python3',
                          resources={'metadata': {'path': str(path.parent)}}).execute()
  tidy(nb)
  return nb


def printed(nb) -> list[list[str]]:
  """Per code cell, what it shows: stream text and ``text/plain`` with the volatile parts masked;
  an image (or any other rich output) by its kind only."""
  cells = []
  for cell in nb.cells:
    if cell.cell_type != 'code':
      continue
    shown = []
    for out in cell.outputs:
      if out.output_type == 'stream':
        shown.append(f'{out.name}: {mask(out.text)}')
      elif out.output_type in ('execute_result', 'display_data'):
        data = out.get('data', {})
        rich = sorted(k for k in data if k != 'text/plain')
        shown.append(f'<{", ".join(rich)}>' if rich else f'result: {mask(data.get("text/plain", ""))}')
      elif out.output_type == 'error':
        shown.append(f'error: {out.ename}: {out.evalue}')
    cells.append(shown)
  return cells


def mask(text: str) -> str:
  for pattern, replacement in _VOLATILE:
    text = pattern.sub(replacement, text)
  return text.rstrip()


def same_text(stored: str, fresh: str, rtol: float = 1e-3) -> bool:
  """Equal text, numbers equal to ``rtol`` (the last printed digits of float results may differ
  between CPUs)."""
  if _NUMBER.sub('#', stored) != _NUMBER.sub('#', fresh):
    return False
  for a, b in zip(_NUMBER.findall(stored), _NUMBER.findall(fresh), strict=True):
    x, y = float(a), float(b)
    if abs(x - y) > rtol * max(abs(x), abs(y)) + 10.0 ** -_decimals(a, b):
      return False
  return True


def _decimals(a: str, b: str) -> int:
  """Printed decimals of the less precise of two numbers (a difference in the last one passes)."""
  def places(s):
    mantissa = re.split('[eE]', s)[0]
    return len(mantissa.split('.')[1]) if '.' in mantissa else 0
  return min(places(a), places(b))


def differences(stored_nb, fresh_nb, rtol: float = 1e-3) -> list[str]:
  """Where the stored outputs differ from a fresh run's, one line per cell (empty: they agree)."""
  stored, fresh = printed(stored_nb), printed(fresh_nb)
  if len(stored) != len(fresh):
    return [f'{len(stored)} code cells stored, {len(fresh)} run']
  found = []
  for k, (a, b) in enumerate(zip(stored, fresh), 1):
    if len(a) != len(b) or not all(same_text(x, y, rtol) for x, y in zip(a, b)):
      found.append(f'code cell {k}:\n  stored: {a!r}\n  fresh:  {b!r}')
  return found


def main(names: list[str]) -> None:
  import nbformat

  paths = [NOTEBOOKS / n if n.endswith('.ipynb') else NOTEBOOKS / f'{n}.ipynb' for n in names] \
    or sorted(NOTEBOOKS.glob('*.ipynb'))
  for path in paths:
    nb = execute(path)
    nbformat.write(nb, path)
    print(f'stored {path.name}')


if __name__ == '__main__':
  main(sys.argv[1:])
