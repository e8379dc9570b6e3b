"""docs/brainstate.md: every brainnx block runs and matches an oracle (a Python loop, jax.lax,
the documented difference); where brainstate is installed (the ``bench`` extra) its block runs
too and both sides agree row by row."""

import importlib.util
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SideBySidePage

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = ['state-value', 'read-states', 'auto-policy', 'environ', 'init-reset', 'bounded-while', 'random']
HAVE_BRAINSTATE = importlib.util.find_spec('brainstate') is not None


BLOCKS = SideBySidePage(ROOT / 'docs' / 'brainstate.md', ('brainstate', 'brainnx'))


def _run(row: str, side: str) -> dict:
  """The block's namespace; ``{}`` for the brainstate side where brainstate is not installed."""
  return BLOCKS.run(row, side) if side == 'brainnx' or HAVE_BRAINSTATE else {}


def test_every_row_has_both_sides_and_the_page_is_in_the_toctree():
  assert sorted({row for row, _ in BLOCKS}) == sorted(ROWS)
  assert all((row, side) in BLOCKS for row in ROWS for side in ('brainstate', 'brainnx'))
  index = (ROOT / 'docs' / 'index.md').read_text()
  assert re.search(r'```\{toctree\}.*\nbrainstate\n.*```', index, flags=re.S)


def test_replacing_a_value():
  ours, theirs = _run('state-value', 'brainnx'), _run('state-value', 'brainstate')
  assert ours['kept'] == (3,) and ours['shape'] == (5,)
  if theirs:
    assert theirs['shape'] == ours['shape']


def test_read_states_differ_by_the_written_ones():
  ours, theirs = _run('read-states', 'brainnx'), _run('read-states', 'brainstate')
  assert len(ours['read']) == 2 and len(ours['written']) == 1
  assert ours['read_only'] == [ours['w']] and ours['written'][0] is ours['h']
  if theirs:
    assert [s is theirs['w'] for s in theirs['read_only']] == [True]
    assert len(theirs['written']) == len(ours['written'])


def test_a_per_element_write_is_refused_until_its_axis_is_declared():
  ours, theirs = _run('auto-policy', 'brainnx'), _run('auto-policy', 'brainstate')
  assert 'state_out_axes={0: nnx.Variable}' in ours['message']
  np.testing.assert_array_equal(ours['stacked'], jnp.arange(4.0))  # a Python loop: 0 + x per element
  if theirs:
    np.testing.assert_array_equal(theirs['stacked'], ours['stacked'])


def test_a_constant_held_by_the_model():
  ours, theirs = _run('environ', 'brainnx'), _run('environ', 'brainstate')
  v, want = np.zeros(3), []
  for _ in range(20):  # the oracle: the same update in a Python loop
    v = v + 0.1 * (1.0 - v) / 10.0
    want.append(v)
  np.testing.assert_allclose(ours['trace'], np.array(want), rtol=1e-5)
  if theirs:
    np.testing.assert_allclose(theirs['trace'], ours['trace'], rtol=1e-6)


def test_initialising_and_resetting_state():
  ours, theirs = _run('init-reset', 'brainnx'), _run('init-reset', 'brainstate')
  np.testing.assert_array_equal(ours['before_reset'], jnp.full(3, 5.0))
  np.testing.assert_array_equal(ours['after_reset'], jnp.zeros(3))
  np.testing.assert_array_equal(ours['cell'].w[...], jnp.ones(3))  # a reset leaves the Params alone
  if theirs:
    np.testing.assert_array_equal(theirs['before_reset'], ours['before_reset'])
    np.testing.assert_array_equal(theirs['after_reset'], ours['after_reset'])


def test_a_bounded_while_loop():
  ours, theirs = _run('bounded-while', 'brainnx'), _run('bounded-while', 'brainstate')
  assert float(ours['value']) == 20.0 / 32 and float(ours['slope']) == 1 / 32  # five halvings
  if theirs:
    assert float(theirs['value']) == float(ours['value']) and float(theirs['slope']) == float(ours['slope'])


def test_random_numbers_per_element():
  ours, theirs = _run('random', 'brainnx'), _run('random', 'brainstate')
  assert ours['noise'].shape == (4,) and len(set(np.asarray(ours['noise']).tolist())) == 4
  assert int(ours['rngs'].default.count[...]) == 1  # the stream advanced once
  if theirs:
    assert theirs['noise'].shape == ours['noise'].shape and len(set(np.asarray(theirs['noise']).tolist())) == 4


@pytest.mark.skipif(not HAVE_BRAINSTATE, reason='brainstate is in the bench extra')
def test_the_brainstate_side_ran():
  assert _run('bounded-while', 'brainstate')['value'] == pytest.approx(0.625)
