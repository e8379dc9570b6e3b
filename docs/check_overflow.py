"""Build the docs site and look at every page in headless Chromium at 1280 px: fail if a code
block (or the page itself) is wider than the window and scrolls sideways.

    python docs/check_overflow.py [--width 1280] [--site DIR]

Needs Chromium (Debian's package ``chromium``, or ``--chromium PATH``) and ``playwright`` from
PyPI; it drives the installed browser, it downloads none. Exit 1 lists each overflowing block as
``page: first line of the block (its width against the box's)``. ``tests/test_docs.py`` runs it
when Chromium is installed; without a browser, the same test suite still holds every code line
to 88 characters.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
                  '--disable-background-networking', '--disable-component-update', '--disable-sync']

# every <pre> (code blocks, notebook outputs) whose content is wider than its box, and the page
OVERFLOW_JS = """() => {
  const wide = [];
  for (const pre of document.querySelectorAll('pre')) {
    if (pre.scrollWidth > pre.clientWidth + 1) {
      const cell = pre.closest('.cell_output') ? 'output' : 'code';
      wide.push(`${cell}: ${pre.innerText.split('\\n')[0].slice(0, 60)} (${pre.scrollWidth} > ${pre.clientWidth} px)`);
    }
  }
  if (document.documentElement.scrollWidth > window.innerWidth + 1) {
    wide.push(`the page is ${document.documentElement.scrollWidth} px wide`);
  }
  return wide;
}"""


def find_chromium(given: str | None) -> str | None:
  return given or shutil.which('chromium') or shutil.which('chromium-browser') or shutil.which('google-chrome')


def build_site(out: Path) -> None:
  subprocess.run([sys.executable, '-m', 'sphinx', '-q', '-b', 'html', '-c', str(ROOT / 'docs'), str(ROOT), str(out)],
                 check=True, timeout=900)


def overflowing(site: Path, chromium: str, width: int, include_outputs: bool = False) -> dict[str, list[str]]:
  """Page (relative to the site) -> its overflowing blocks, for every page of the docs and notebooks."""
  from playwright.sync_api import sync_playwright

  pages = sorted(p for folder in ('docs', 'notebooks') for p in (site / folder).rglob('*.html'))
  found = {}
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
    page = browser.new_page(viewport={'width': width, 'height': 900})
    for html in pages:
      page.goto(html.as_uri())
      wide = [w for w in page.evaluate(OVERFLOW_JS) if include_outputs or not w.startswith('output:')]
      if wide:
        found[str(html.relative_to(site))] = wide
    browser.close()
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--width', type=int, default=1280, help='window width in px (default 1280)')
  parser.add_argument('--site', type=Path, default=None, help='an already built site (default: build one)')
  parser.add_argument('--chromium', default=None, help='the browser binary (default: chromium on PATH)')
  parser.add_argument('--outputs', action='store_true', help="count notebook outputs too, not only code")
  args = parser.parse_args(argv)
  chromium = find_chromium(args.chromium)
  if chromium is None:
    parser.error('no Chromium found: apt-get install chromium, or pass --chromium PATH')
  with tempfile.TemporaryDirectory() as scratch:
    site = args.site
    if site is None:
      site = Path(scratch) / 'site'
      build_site(site)
    found = overflowing(site, chromium, args.width, args.outputs)
  for page, wide in found.items():
    for line in wide:
      print(f'{page}: {line}')
  print(f'{sum(map(len, found.values()))} overflowing block(s) at {args.width} px')
  return 1 if found else 0


if __name__ == '__main__':
  raise SystemExit(main())
