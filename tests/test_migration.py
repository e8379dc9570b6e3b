"""docs/migration.md: both sides of every row run, and agree where the page says they do; flax's
words (nnx.StateAxes, swapped keys, nnx.split_rngs, an integer Param under grad) get answers in
code. Oracles: flax.nnx's own transforms, and Python loops over members."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import SideBySidePage, assert_oracle_close, assert_same_values, values_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / 'docs' / 'migration.md').read_text()
ROWS = ['vmap-stateaxes', 'split-rngs', 'vmap-init', 'loop-carry', 'scan-carry', 'scan-layers', 'broadcast-stream', 'cached-partial', 'donate',
        'shard-statesharding', 'grad-diffstate']
BLOCKS = SideBySidePage(ROOT / 'docs' / 'migration.md', ('flax', 'brainnx'))
_run = BLOCKS.run


def test_every_row_has_both_sides_and_the_page_is_in_the_toctree():
  assert sorted({row for row, _ in BLOCKS}) == sorted(ROWS)
  assert all((row, side) in BLOCKS for row in ROWS for side in ('flax', 'brainnx'))
  index = (ROOT / 'docs' / 'index.md').read_text()
  assert re.search(r'```\{toctree\}.*\nmigration\n.*```', index, flags=re.S)
  assert 'restarts each\nmember\'s count at 0' in PAGE or "restarts each member's count at 0" in PAGE.replace('\n', ' ')


def test_vmap_with_state_axes():
  flax, ours = _run('vmap-stateaxes', 'flax'), _run('vmap-stateaxes', 'brainnx')
  np.testing.assert_allclose(ours['model'].lin.kernel[...], flax['model'].lin.kernel[...], rtol=1e-6)
  assert ours['model'].temperature.shape == flax['model'].temperature.shape == ()
  np.testing.assert_allclose(ours['out'], flax['out'], rtol=1e-6)
  np.testing.assert_allclose(ours['same'], flax['out'], rtol=1e-6)


def test_split_rngs_on_a_fresh_stream():
  flax, ours = _run('split-rngs', 'flax'), _run('split-rngs', 'brainnx')
  np.testing.assert_allclose(ours['model'].kernel[...], flax['model'].kernel[...], rtol=1e-6)
  assert int(ours['rngs'].default.count[...]) == int(flax['rngs'].default.count[...]) == 1


def test_split_rngs_restarts_counts_where_brainnx_keeps_the_streams():
  """The page's sentence, against its formula: member i draws from split(fold_in(key, c))[i]
  with count 0 (flax) or count c (brainnx)."""
  def member(c, i, count):
    r = nnx.Rngs(jax.random.split(jax.random.fold_in(jax.random.key(0), c), 4)[i])
    r.default.count[...] = count
    return nnx.Linear(3, 2, rngs=r).kernel[...]

  ours_rngs, flax_rngs = nnx.Rngs(0), nnx.Rngs(0)
  ours_rngs(), ours_rngs(), flax_rngs(), flax_rngs()   # count 2
  ours = bnx.vmap(lambda: nnx.Linear(3, 2, rngs=ours_rngs), axis_size=4)()
  flax = nnx.split_rngs(splits=4)(nnx.vmap(lambda r: nnx.Linear(3, 2, rngs=r), in_axes=0))(flax_rngs)
  for i in range(4):
    np.testing.assert_allclose(ours.kernel[i], member(2, i, 2), rtol=1e-6)
    np.testing.assert_allclose(flax.kernel[i], member(2, i, 0), rtol=1e-6)
  assert not np.allclose(ours.kernel[...], flax.kernel[...])


def test_a_stack_built_in_the_constructor():
  flax, ours = _run('vmap-init', 'flax'), _run('vmap-init', 'brainnx')
  assert ours['stack'].lin.kernel.shape == flax['stack'].lin.kernel.shape == (4, 2, 3)
  np.testing.assert_allclose(ours['stack'].lin.kernel[...], flax['stack'].lin.kernel[...], rtol=1e-6)
  np.testing.assert_allclose(ours['stack'].lin.bias[...], flax['stack'].lin.bias[...], rtol=1e-6)


def test_bnx_vmap_on_a_constructor_names_vmap_new_states():
  class Stack(nnx.Module):
    @bnx.vmap(in_axes=(None, None), axis_size=4)
    def __init__(self, rngs):
      self.lin = nnx.Linear(2, 3, rngs=rngs)

  with pytest.raises(bnx.BatchAxisError, match='vmap_new_states'):
    Stack(nnx.Rngs(0))


def test_a_module_in_a_loop_carry():
  flax, ours = _run('loop-carry', 'flax'), _run('loop-carry', 'brainnx')
  for side in (flax, ours):
    assert int(side['counter'].count[...]) == 5 and float(side['counter'].total[...]) == 2.0 * sum(range(5))


def test_split_rngs_around_bnx_vmap_gives_flax_keys_on_a_used_stream():
  """The recipe for flax's exact dropout keys: flax's split kept around a mapping bnx.vmap."""
  def draws(vmap, rngs):
    return nnx.split_rngs(splits=4)(vmap(lambda r: r.dropout.uniform((3,)), in_axes=0))(rngs)

  ours, theirs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
  ours.dropout(), theirs.dropout()  # a stream already drawn from
  np.testing.assert_array_equal(draws(bnx.vmap, ours), draws(nnx.vmap, theirs))


def test_scan_with_carry():
  flax, ours = _run('scan-carry', 'flax'), _run('scan-carry', 'brainnx')
  np.testing.assert_allclose(ours['ys'], flax['ys'], rtol=1e-6)
  np.testing.assert_allclose(ours['h'], flax['h'], rtol=1e-6)
  assert int(ours['cell'].calls[...]) == int(flax['cell'].calls[...]) == 5


def test_scan_over_layers():
  flax, ours = _run('scan-layers', 'flax'), _run('scan-layers', 'brainnx')
  np.testing.assert_allclose(ours['stack'].kernel[...], flax['stack'].kernel[...], rtol=1e-6)
  np.testing.assert_allclose(ours['h'], flax['h'], rtol=1e-5)
  h = np.ones(3)
  for i in range(4):  # a Python loop over the layers
    h = np.tanh(h @ np.asarray(ours['stack'].kernel[i]) + np.asarray(ours['stack'].bias[i]))
  assert_oracle_close(ours['h'], h)


def test_broadcast_stream_brainnx_side():  # at every pinned flax: flax 0.12.4 has no nnx.with_rngs
  ours = _run('broadcast-stream', 'brainnx')
  masks = np.asarray(ours['masks'])
  assert masks.shape == (4, 6) and (masks == masks[0]).all() and 0 < int((masks[0] == 0).sum()) < 6
  assert int(ours['rngs'].dropout.count[...]) == 1


@pytest.mark.skipif(not hasattr(nnx, 'with_rngs'), reason='nnx.with_rngs is in flax 0.12.5 and later (the page says so)')
def test_broadcast_stream():
  flax, ours = _run('broadcast-stream', 'flax'), _run('broadcast-stream', 'brainnx')
  for masks in (flax['masks'], ours['masks']):
    assert masks.shape == (4, 6) and (np.asarray(masks) == np.asarray(masks[0])).all()
    assert 0 < int((np.asarray(masks[0]) == 0).sum()) < 6
  assert int(ours['rngs'].dropout.count[...]) == int(flax['rngs'].dropout.count[...]) == 1
  # flax's broadcast copies, mapped by brainnx, give flax's masks exactly
  rngs = nnx.Rngs(params=0, dropout=1)
  shared = nnx.with_rngs(rngs, broadcast=4, graph=False)
  drop, x = nnx.Dropout(0.5), jnp.ones(6)
  np.testing.assert_array_equal(bnx.vmap(lambda r: drop(x, rngs=r), in_axes=0)(shared), flax['masks'])


def test_cached_partial():
  flax, ours = _run('cached-partial', 'flax'), _run('cached-partial', 'brainnx')
  np.testing.assert_allclose(ours['losses'], flax['losses'], rtol=1e-5)
  np.testing.assert_allclose(ours['model'].kernel[...], flax['model'].kernel[...], rtol=1e-5)


def test_donated_steps():
  flax, ours = _run('donate', 'flax'), _run('donate', 'brainnx')
  np.testing.assert_allclose(ours['losses'], flax['losses'], rtol=1e-5)
  np.testing.assert_allclose(ours['model'].kernel[...], flax['model'].kernel[...], rtol=1e-5)
  assert ours['old_kernel'].is_deleted() and flax['old_kernel'].is_deleted()


def test_state_sharding_in_shard_map():
  flax, ours = _run('shard-statesharding', 'flax'), _run('shard-statesharding', 'brainnx')
  np.testing.assert_allclose(ours['out'], flax['out'], rtol=1e-6)
  a, b = ours['model'].kernel[...], flax['model'].kernel[...]
  assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def test_grad_with_diff_state():
  flax, ours = _run('grad-diffstate', 'flax'), _run('grad-diffstate', 'brainnx')
  assert sorted(ours['grads']) == sorted(flax['grads']) == ['backbone']
  for got, want in ((ours['grads'], flax['grads']), (ours['by_filter']['model'], flax['grads'])):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), nnx.to_pure_dict(got), nnx.to_pure_dict(want))


# -- nnx.StateAxes: read as the state_in_axes it means ------------------------------------


class Net(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 2, rngs=rngs)
    self.stat = nnx.BatchStat(jnp.full((2,), 0.5))

  def __call__(self, x):
    return self.lin(x) * self.stat[...]


def _net():
  keys = jax.random.split(jax.random.key(3), 4)
  axes = nnx.StateAxes({nnx.Param: 0, ...: None})
  return nnx.vmap(lambda k: Net(nnx.Rngs(k)), in_axes=0, out_axes=axes)(keys), axes


X = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)


def test_state_axes_in_in_axes_and_as_state_in_axes_equal_nnx_vmap():
  model, axes = _net()
  want = nnx.vmap(lambda m, x: m(x), in_axes=(axes, None))(model, X)
  np.testing.assert_allclose(bnx.vmap(lambda m, x: m(x), in_axes=(axes, None))(model, X), want, rtol=1e-6)
  np.testing.assert_allclose(bnx.vmap(lambda m: m(X), in_axes=axes)(model), want, rtol=1e-6)
  np.testing.assert_allclose(bnx.vmap(lambda x: model(x), in_axes=None, state_in_axes=axes)(X), want, rtol=1e-6)
  # a StateAxes mapping the data argument's axis too
  xs = jnp.stack([X] * 4) * jnp.arange(1.0, 5.0)[:, None, None]
  want = nnx.vmap(lambda m, x: m(x), in_axes=(nnx.StateAxes({nnx.BatchStat: None, ...: 0}), 0))(model, xs)
  got = bnx.vmap(lambda m, x: m(x), in_axes=(nnx.StateAxes({nnx.BatchStat: None, ...: 0}), 0))(model, xs)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_state_axes_in_in_axes_applies_to_its_argument_only():
  model, axes = _net()
  other = nnx.Param(jnp.arange(4.0))  # a closure Param the StateAxes of argument 0 does not see
  got = bnx.vmap(lambda m, x: m(x).sum() * other[...], in_axes=(axes, None))(model, X)
  sums = np.stack([np.asarray(X @ model.lin.kernel[i] + model.lin.bias[i]) * 0.5 for i in range(4)]).sum((1, 2))
  np.testing.assert_allclose(got, sums[:, None] * np.arange(4.0)[None, :], rtol=1e-5)  # other broadcast


def test_a_state_axes_entry_matching_nothing_is_named():
  model, _ = _net()
  with pytest.raises(ValueError, match=r"in_axes\[0\] nnx.StateAxes entry \{nnx\.Intermediate: 0\} matches none"):
    bnx.vmap(lambda m, x: m(x), in_axes=(nnx.StateAxes({nnx.Intermediate: 0, ...: None}), None))(model, X)


def test_a_state_axes_filter_does_not_reach_the_modules_of_other_arguments():
  """in_axes=(StateAxes({Param: 0, ...: None}), None): the second Module's Params are broadcast,
  as nnx.vmap gives them, not mapped by the first argument's filter."""
  model, axes = _net()
  shared = Net(nnx.Rngs(9))
  f = lambda m, s, x: m(x) + s(x)  # noqa: E731
  want = nnx.vmap(f, in_axes=(axes, None, None))(model, shared, X)
  np.testing.assert_allclose(bnx.vmap(f, in_axes=(axes, None, None))(model, shared, X), want, rtol=1e-6)


def test_a_state_axes_entry_of_scan_matching_nothing_is_named_as_written():
  """scan reads an nnx.StateAxes as state_in_axes; an entry that matches nothing is shown as the
  user wrote it (one filter, not a tuple of one)."""
  rngs = nnx.Rngs(0)
  stack = bnx.vmap(lambda: nnx.Linear(3, 3, rngs=rngs), axis_size=4)()
  layers = lambda h, _: (stack(h), None)  # noqa: E731
  with pytest.raises(ValueError, match=r"scan: state_in_axes entry \{None: nnx\.BatchStat\} matches none"):
    bnx.scan(layers, jnp.ones(3), None, length=4, state_in_axes=nnx.StateAxes({nnx.BatchStat: None, nnx.Param: 0}))
  got = bnx.scan(layers, jnp.ones(3), None, length=4, state_in_axes=nnx.StateAxes({nnx.Param: 0}))[0]
  want = jnp.ones(3)
  for i in range(4):  # the oracle: a Python loop over the layers
    want = want @ stack.kernel[i] + stack.bias[i]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_swapped_keys_are_answered_with_the_rewrite():
  model, _ = _net()
  with pytest.raises(TypeError, match=r"did you mean state_in_axes=\{0: nnx\.Param\}\?"):
    bnx.vmap(lambda x: model(x), in_axes=None, state_in_axes={nnx.Param: 0})
  with pytest.raises(TypeError, match=r"did you mean state_in_axes=\{0: nnx\.Param, None: \.\.\.\}\? .*nnx\.StateAxes\(\{nnx\.Param: 0, \.\.\.: None\}\)"):
    bnx.vmap(lambda x: model(x), in_axes=None, state_in_axes={nnx.Param: 0, ...: None})


def test_state_axes_where_brainnx_cannot_read_it_gives_the_rewrite():
  model, axes = _net()
  rngs = nnx.Rngs(0)
  with pytest.raises(TypeError, match=r"write out_axes=0, state_out_axes=\{0: nnx\.Param, None: \.\.\.\}"):
    bnx.vmap(lambda: Net(rngs), axis_size=2, out_axes=axes)()
  with pytest.raises(TypeError, match=r"state_in_axes=\{0: nnx\.Param, None: \.\.\.\}"):
    bnx.vmap(lambda d, x: d['m'](x), in_axes=({'m': axes}, None))({'m': model}, X)


# -- nnx.split_rngs, explained --------------------------------------------------------------


def test_split_rngs_inside_the_mapped_function_is_explained():
  rngs = nnx.Rngs(0)
  before = values_of(rngs)

  def make():
    return nnx.split_rngs(splits=4)(lambda r: nnx.Linear(2, 3, rngs=r))(rngs)

  with pytest.raises(ValueError, match=r"nnx\.split_rngs was applied inside the mapped function.*remove nnx\.split_rngs"):
    bnx.vmap(make, axis_size=4)()
  assert_same_values(before, values_of(rngs))
  made = bnx.vmap(lambda: nnx.Linear(2, 3, rngs=rngs), axis_size=4)()  # the fix
  assert made.kernel.shape == (4, 2, 3)


def test_a_split_stream_broadcast_into_vmap_is_refused_with_the_way_to_map_it():
  rngs = nnx.Rngs(0)

  @nnx.split_rngs(splits=4)
  @bnx.vmap(in_axes=None, axis_size=4)
  def make(rngs):
    return nnx.Linear(2, 3, rngs=rngs)

  with pytest.raises(bnx.BatchAxisError, match=r"RngKey at \(0, 'default', 'key'\) holds 4 keys.*drop nnx\.split_rngs.*state_in_axes=\{0: nnx\.RngState\}"):
    make(rngs)
  # the stream mapped as the message says: the members are flax's
  ours = nnx.split_rngs(splits=4)(bnx.vmap(lambda r: nnx.Linear(2, 3, rngs=r), in_axes=None, axis_size=4, state_in_axes={0: nnx.RngState}))(nnx.Rngs(0))
  flax = nnx.split_rngs(splits=4)(nnx.vmap(lambda r: nnx.Linear(2, 3, rngs=r), in_axes=0))(nnx.Rngs(0))
  np.testing.assert_allclose(ours.kernel[...], flax.kernel[...], rtol=1e-6)


def test_split_rngs_kept_around_a_mapped_vmap_is_accepted_and_gives_flax_members():
  """The table's row as written: nnx.split_rngs around bnx.vmap with the Rngs mapped (in_axes=0)."""
  ours = nnx.split_rngs(splits=4)(bnx.vmap(lambda r: nnx.Linear(2, 3, rngs=r), in_axes=0))(nnx.Rngs(0))
  flax = nnx.split_rngs(splits=4)(nnx.vmap(lambda r: nnx.Linear(2, 3, rngs=r), in_axes=0))(nnx.Rngs(0))
  np.testing.assert_allclose(ours.kernel[...], flax.kernel[...], rtol=1e-6)
  assert len({tuple(np.asarray(k).ravel()) for k in ours.kernel[...]}) == 4  # four different members


class _Dropped(nnx.Module):
  def __init__(self):
    self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

  def __call__(self, x):
    return self.drop(self.lin(x))


def test_a_flax_state_axes_mapping_an_unsplit_stream_is_told_to_drop_it():
  """A flax port without nnx.split_rngs: the hint, pasted, gives one mask per element as flax's
  split_rngs + vmap does (broadcasting the stream would give every element the same mask)."""
  xs = jnp.ones((4, 3))
  flax_axes = nnx.StateAxes({'dropout': 0, ...: None})
  with pytest.raises(ValueError, match=r"holds one key.*Drop the rule for it \(the 'dropout' entry of your nnx\.StateAxes"):
    bnx.vmap(lambda m, x: m(x), in_axes=(flax_axes, 0))(_Dropped(), xs)
  ours = bnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(_Dropped(), xs)  # the StateAxes dropped

  @nnx.split_rngs(splits=4, only='dropout')
  @nnx.vmap(in_axes=(flax_axes, 0))
  def theirs(m, x):
    return m(x)

  want = theirs(_Dropped(), xs)
  masks, want_masks = np.asarray(ours) != 0, np.asarray(want) != 0
  assert len({m.tobytes() for m in masks}) == 4  # one mask per element, as flax's
  np.testing.assert_array_equal(masks, want_masks)  # and the same keys: split from the same stream


# -- hints in code, never placeholders --------------------------------------------------------


def test_an_integer_param_under_grad_is_told_what_to_do_instead():
  class Counted(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))
      self.step = nnx.Param(jnp.array(0))

    def __call__(self, x):
      return (self.w[...] * x).sum()

  model = Counted()
  with pytest.raises(TypeError, match=r"Param at \('model', 'step'\) \(dtype int32\).*selects it too.*grad_states=nnx\.All\(nnx\.Param, nnx\.Not\(nnx\.PathContains\('step'\)\)\)"):
    bnx.grad(lambda x: model(x), grad_states=nnx.Param)(jnp.ones(2))
  grads = bnx.grad(lambda x: model(x), grad_states=nnx.All(nnx.Param, nnx.Not(nnx.PathContains('step'))))(jnp.arange(2.0))
  np.testing.assert_array_equal(grads['model']['w'][...], jnp.arange(2.0))  # d/dw of w . x is x


def test_axis_hints_name_a_real_filter():
  v = nnx.Param(jnp.ones(3))
  with pytest.raises(ValueError, match=r"broadcast it with state_in_axes=\{None: nnx\.Param\}"):
    bnx.vmap(lambda x: x * v[...], state_in_axes={1: nnx.Param})(jnp.ones((3, 3)))
  s = nnx.BatchStat(jnp.zeros(()))

  def write(x):
    s[...] = x.sum()
    return x

  with pytest.raises(bnx.BatchAxisError, match=r"state_out_axes=\{0: nnx\.BatchStat\}"):
    bnx.vmap(write)(jnp.ones((3, 2)))
  with pytest.raises(bnx.BatchAxisError, match=r"e\.g\. state_out_axes=\{0: nnx\.BatchStat\}"):
    bnx.vmap(write, state_out_axes={None: nnx.BatchStat})(jnp.ones((3, 2)))


def test_no_message_in_the_package_uses_a_placeholder_filter():
  for path in (ROOT / 'brainnx').rglob('*.py'):
    for n, line in enumerate(path.read_text().splitlines(), 1):
      if '>>>' in line:
        continue
      assert '<its filter>' not in line and '{{None: ...}}' not in line, f'{path.name}:{n}: {line.strip()}'
