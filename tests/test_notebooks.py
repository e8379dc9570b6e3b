"""The notebooks run top to bottom and print what their stored outputs say.

Each notebook is executed in a fresh kernel (``notebook_outputs.execute``) and its printed text
compared with the stored text, cell by cell: timings, rates and addresses are masked, numbers
agree to 1e-3, images count by presence. To refresh a notebook after changing it, run
``python tests/notebook_outputs.py NAME``.
"""

import copy

import pytest

nbformat = pytest.importorskip('nbformat', reason='needs the notebook tools of the dev extra')

from notebook_outputs import NOTEBOOKS, differences, execute, printed, tidy  # noqa: E402  (needs nbformat)

PATHS = sorted(NOTEBOOKS.glob('*.ipynb'))


@pytest.mark.parametrize('path', PATHS, ids=lambda p: p.stem)
def test_notebook_runs_and_prints_its_stored_outputs(path):
  stored = nbformat.read(path, as_version=4)
  assert not tidy(copy.deepcopy(stored)), (
    f'{path.name}: stored outputs are not tidied (progress bars as many blocks or with carriage '
    f'returns): run python tests/notebook_outputs.py {path.stem}')
  found = differences(stored, execute(path))
  assert not found, (f'{path.name}: stored outputs differ from a fresh run; refresh with '
                     f'python tests/notebook_outputs.py {path.stem}\n' + '\n'.join(found))


def test_a_stale_output_is_caught():
  """The comparison's own oracle: a changed word, a changed number and a lost image all differ;
  a changed timing (and the padding it shifts), rate, address or last printed digit does not."""
  nb = nbformat.v4.new_notebook()
  nb.cells = [nbformat.v4.new_code_cell(outputs=[
    nbformat.v4.new_output('stream', name='stdout', text='state_out_axes={0: nnx.Variable} loss 0.1234\n'),
    nbformat.v4.new_output('stream', name='stderr', text='\r 0%|   | 0/50 [00:00<?, ?it/s]\r100%|###| 50/50 '
                                                           '[00:01<00:00, 38.04it/s]\n'),
    nbformat.v4.new_output('display_data', data={'image/png': 'iVBO', 'text/plain': '<Figure at 0x7f3a>'}),
  ])]
  tidy(nb)
  assert nb.cells[0].outputs[1].text == '100%|###| 50/50 [00:01<00:00, 38.04it/s]\n'

  def variant(edit):
    other = copy.deepcopy(nb)
    edit(other.cells[0].outputs)
    return differences(nb, other)

  def set_text(k, text):
    return lambda outs: outs[k].update(text=text)

  assert not variant(set_text(0, 'state_out_axes={0: nnx.Variable} loss 0.1235\n'))  # the last digit
  assert not variant(set_text(1, '100%|###| 50/50 [00:03<00:00, 12.5it/s]\n'))  # timing and rate
  assert variant(set_text(0, 'state_out_axes={0: <its filter>} loss 0.1234\n'))
  assert variant(set_text(0, 'state_out_axes={0: nnx.Variable} loss 0.2234\n'))
  assert variant(lambda outs: outs.pop(2))
  assert printed(nb)[0][2] == '<image/png>'

  # a table of timings: a time that takes more digits shifts its padding, which is not a change
  table = nbformat.v4.new_notebook()
  table.cells = [nbformat.v4.new_code_cell(outputs=[
    nbformat.v4.new_output('stream', name='stdout', text='unrolled        9.8 s    0.5 s   492\n'),
  ])]
  widened = copy.deepcopy(table)
  widened.cells[0].outputs[0].text = 'unrolled       10.4 s    0.5 s   492\n'
  assert not differences(table, widened)
  widened.cells[0].outputs[0].text = 'unrolled       10.4 s    0.5 s   510\n'
  assert differences(table, widened)
