"""A cached plan notices every way its graph can change, also after warm calls took the fast path.

Warm calls compare the attributes of flax Pytrees only when flax reports an edit
(``_compat.PYTREE_EDITS``); plain dicts, lists and objects are compared on every call.
Each case makes several warm calls, changes the model one way, and checks the next call
against the same model called eagerly (an ``nnx.clone`` taken just before the call).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from brainnx import _compat
from helpers import MLP, assert_same_tree

X = jax.random.normal(jax.random.key(0), (4, 3))


class Net(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])
    self.gains = nnx.Dict(scale=nnx.Param(jnp.ones(3)))
    self.factor = 1.0  # a static attribute the trace bakes in
    self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    x = self.drop(x * self.gains['scale'][...] * self.factor)
    skip = getattr(self, 'skip', None)
    return x if skip is None else x + skip(x)


def _replace_kernel(net):
  net.layers[0].kernel = nnx.Param(jnp.full((3, 3), 0.5))


def _static(net):
  net.factor = 2.5


def _add_submodule(net):
  net.skip = nnx.Linear(3, 3, rngs=nnx.Rngs(5))


def _delete_submodule(net):
  del net.skip


def _list_append(net):
  net.layers.append(nnx.Linear(3, 3, rngs=nnx.Rngs(6)))


def _list_setitem(net):
  net.layers[1] = nnx.Linear(3, 3, rngs=nnx.Rngs(7))


def _list_pop(net):
  net.layers.pop()


def _dict_setitem(net):
  net.gains['scale'] = nnx.Param(jnp.full((3,), 3.0))


def _train_mode(net):
  net.train()  # nnx.Module.train sets Dropout.deterministic through setattr


def _update_values(net):
  other = Net(nnx.Rngs(9))
  nnx.update(net, nnx.state(other, nnx.Param))


def _nnx_jit_in_place(net):
  # nnx.jit writes back by clearing and re-filling the attribute dicts of the nodes it updates
  @nnx.jit
  def scale_kernel(m):
    m.layers[0].kernel[...] = m.layers[0].kernel[...] * 2.0

  scale_kernel(net)


def _nnx_jit_new_variable(net):
  @nnx.jit
  def attach(m):
    m.layers[0].kernel = nnx.Param(jnp.eye(3))

  attach(net)


CHANGES = [
  _replace_kernel, _static, _add_submodule, _delete_submodule, _list_append, _list_setitem, _list_pop,
  _dict_setitem, _train_mode, _update_values, _nnx_jit_in_place, _nnx_jit_new_variable,
]


@pytest.mark.parametrize('as_argument', [False, True], ids=['closure', 'argument'])
@pytest.mark.parametrize('change', CHANGES, ids=lambda f: f.__name__.strip('_'))
def test_warm_plan_follows_change(change, as_argument):
  net = Net(nnx.Rngs(0))
  if change is _delete_submodule:
    _add_submodule(net)
  f = bnx.jit(lambda m, x: m(x)) if as_argument else bnx.jit(lambda x: net(x))
  call = (lambda: f(net, X)) if as_argument else (lambda: f(X))
  for _ in range(3):  # cold, then warm calls: the last ones skip the Pytree comparison
    expected = nnx.clone(net)(X)
    np.testing.assert_allclose(call(), expected, rtol=1e-6)
  before = nnx.clone(net)(X)
  change(net)
  for _ in range(2):
    twin = nnx.clone(net)
    expected = twin(X)
    np.testing.assert_allclose(call(), expected, rtol=1e-6)
    # the Rngs advance as in the eager call (dropout draws only in train mode)
    np.testing.assert_array_equal(nnx.state(net, nnx.RngCount), nnx.state(twin, nnx.RngCount))
  if change not in (_train_mode,):
    assert not np.allclose(before, expected), 'the change should change the output'


def test_plain_containers_are_compared_on_every_call():
  """A plain dict is invisible to flax's edit count: its entries are compared every call."""
  weights = {'w': nnx.Param(jnp.ones((3, 2)))}
  f = bnx.jit(lambda x: x @ weights['w'][...])
  for _ in range(3):
    np.testing.assert_allclose(f(X), X @ jnp.ones((3, 2)), rtol=1e-6)
  edits = _compat.PYTREE_EDITS.n
  weights['w'] = nnx.Param(jnp.full((3, 2), 2.0))
  assert _compat.PYTREE_EDITS.n == edits  # no flax edit happened
  np.testing.assert_allclose(f(X), X @ jnp.full((3, 2), 2.0), rtol=1e-6)
  np.testing.assert_allclose(f(X), X @ jnp.full((3, 2), 2.0), rtol=1e-6)


def test_plain_object_holding_module_is_compared_on_every_call():
  class Holder:
    def __init__(self, model):
      self.model = model

  holder = Holder(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
  f = bnx.jit(lambda x: holder.model(x))
  for _ in range(3):
    f(X)
  holder.__dict__['model'] = replacement = nnx.Linear(3, 2, rngs=nnx.Rngs(1))  # no setattr hook
  np.testing.assert_allclose(f(X), replacement(X), rtol=1e-6)


@pytest.mark.parametrize('edit', ['setattr', 'delattr', 'clear_init', 'setstate'])
def test_every_flax_attribute_edit_is_counted(edit):
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  before = _compat.PYTREE_EDITS.n
  if edit == 'setattr':
    model.note = 'x'
  elif edit == 'delattr':
    model.note = 'x'
    before = _compat.PYTREE_EDITS.n
    del model.note
  elif edit == 'clear_init':
    nnx.jit(lambda m: m.kernel.set_value(m.kernel[...] + 1))(model)
  else:
    model.__setstate__(model.__getstate__())
  assert _compat.PYTREE_EDITS.n > before


def test_user_module_classes_count_edits():
  """A Module class defined after brainnx was imported registers the counting methods too."""

  class Late(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))

  m = Late()
  f = bnx.jit(lambda: m.w[...].sum())
  f(), f(), f()
  m.w = nnx.Param(jnp.full(2, 4.0))
  assert float(f()) == 8.0


# -- names rebound between calls ---------------------------------------------------------------------

M_GUARD = None


SCALE_GUARD = 2.0


def test_global_rebound_from_none_to_module():
  """A global rebound from None to a module is seen by the next call."""
  global M_GUARD
  M_GUARD = None
  try:
    f = bnx.jit(lambda x: x if M_GUARD is None else M_GUARD(x))
    x = jnp.ones(2)
    assert_same_tree(f(x), x)
    M_GUARD = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    y = f(x)
    assert y.shape == (3,)
    np.testing.assert_allclose(y, M_GUARD(x), rtol=1e-6)
  finally:
    M_GUARD = None


def test_closure_rebound_from_none_to_module():
  """A closure cell rebound from None to a module is seen by the next call."""
  m = None
  f = bnx.jit(lambda x: x if m is None else m(x))
  x = jnp.ones(2)
  assert_same_tree(f(x), x)
  m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  y = f(x)
  assert y.shape == (3,)
  np.testing.assert_allclose(y, m(x), rtol=1e-6)


def test_global_float_rebound():
  """A global float the trace read is guarded: 2.0 -> 3.0 changes the result (unlike jax.jit)."""
  global SCALE_GUARD
  SCALE_GUARD = 2.0
  try:
    f = bnx.jit(lambda x: x * SCALE_GUARD)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(f(x), x * 2.0)
    SCALE_GUARD = 3.0
    np.testing.assert_array_equal(f(x), x * 3.0)
  finally:
    SCALE_GUARD = 2.0


def test_closure_float_rebound():
  """A closure float the trace read is guarded: 2.0 -> 3.0 changes the result."""
  scale = 2.0
  f = bnx.jit(lambda x: x * scale)
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(f(x), x * 2.0)
  scale = 3.0
  np.testing.assert_array_equal(f(x), x * 3.0)


def test_a_variable_replaced_by_an_equal_one_is_seen():
  class Holder(nnx.Module):
    def __init__(self):
      self.v = nnx.Variable(jnp.zeros(()))

  holder = Holder()

  @bnx.jit
  def bump():
    holder.v[...] += 1

  bump()
  old = holder.v
  holder.v = nnx.Variable(old[...])  # a new object with an equal value: compared by identity
  bump()
  assert float(holder.v[...]) == 2.0 and float(old[...]) == 1.0


# -- edits elsewhere: a warm call costs what changed, not the graph -------------------------


def _counting_entry_checks(monkeypatch):
  """Every full comparison a guard built from now on runs, counted."""
  from brainnx._engine import guard as guard_module

  calls = [0]
  real = guard_module._entry_check

  def counted(containers, masks):
    check = real(containers, masks)
    if check is None:
      return None

    def wrapped():
      calls[0] += 1
      return check()

    wrapped.resave = check.resave
    return wrapped

  monkeypatch.setattr(guard_module, '_entry_check', counted)
  return calls


def test_edits_of_other_objects_do_not_make_a_warm_call_compare_the_graph(monkeypatch):
  calls = _counting_entry_checks(monkeypatch)
  model = MLP(2, 8, 1, rngs=nnx.Rngs(0))
  f = bnx.jit(lambda x: model(x))
  x = jnp.ones((3, 2))
  f(x)
  f(x)
  before = calls[0]
  for k in range(3):  # flax Pytrees built and edited elsewhere: nothing of ours
    other = nnx.Linear(2, 2, rngs=nnx.Rngs(k))
    other.extra = nnx.Param(jnp.ones(2))
    np.testing.assert_allclose(f(x), model(x), rtol=1e-6)
  assert calls[0] == before  # the graph's entries were not compared


def test_an_nnx_jit_call_between_calls_costs_a_comparison_not_a_new_discovery(monkeypatch):
  """nnx.jit merges the caller's own nodes in place on every call (their attribute dicts are
  cleared and refilled, their trace state replaced): the next brainnx call compares the graph's
  entries, finds them the same, and stays warm."""
  from brainnx._engine import jitted

  model = MLP(2, 8, 1, rngs=nnx.Rngs(0))
  f = bnx.jit(lambda x: model(x))
  evaluate = nnx.jit(lambda m, x: m(x))
  x = jnp.ones((3, 2))
  f(x)
  evaluate(model, x)  # its first call re-creates the attribute dicts in sorted order: a new
  f(x)  # order of entries, which the next brainnx call discovers once
  discoveries = []
  real = jitted.discover
  monkeypatch.setattr(jitted, 'discover', lambda *a: discoveries.append(1) or real(*a))
  for _ in range(3):
    np.testing.assert_allclose(evaluate(model, x), model(x), rtol=1e-6)
    np.testing.assert_allclose(f(x), model(x), rtol=1e-6)
  assert discoveries == []


def test_a_variable_replaced_by_one_of_its_type_on_every_call_costs_no_new_discovery(monkeypatch):
  """``self.h = nnx.Variable(...)`` on every call (what a model recording its last hidden state
  does): the call follows the new Variable, so the next one needs no new discovery; the values
  are eager Python's."""
  from brainnx._engine import jitted

  class Recorder(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.arange(3.0))
      self.h = nnx.Variable(jnp.zeros(3))

    def __call__(self, x):
      self.h = nnx.Variable(self.h[...] + x * self.w[...])
      return self.h[...].sum()

  ours, eager = Recorder(), Recorder()
  f, x = bnx.jit(lambda x: ours(x)), jnp.ones(3)
  f(x), f(x), eager(x), eager(x)
  discoveries = []
  real = jitted.discover
  monkeypatch.setattr(jitted, 'discover', lambda *a: discoveries.append(1) or real(*a))
  for _ in range(3):
    np.testing.assert_allclose(f(x), eager(x), rtol=1e-6)
  np.testing.assert_allclose(ours.h[...], eager.h[...], rtol=1e-6)
  assert discoveries == []


def test_metadata_set_on_a_followed_variable_among_edits_elsewhere_is_seen():
  """A Variable replaced from outside by one of its type is followed, not discovered again;
  metadata set on the replacement later, among a burst of edits of another model, retraces as
  eager Python reads it: the replacement's edits are this guard's, not somebody else's."""

  class Scaled(nnx.Module):
    def __init__(self):
      self.h = nnx.Variable(jnp.ones(3), scale=1.0)

    def __call__(self, x):
      return x * self.h[...] * self.h.get_metadata()['scale']

  ours, eager, elsewhere = Scaled(), Scaled(), nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  f, x = bnx.jit(lambda x: ours(x)), jnp.arange(3.0)
  f(x), f(x)
  for model in (ours, eager):
    model.h = nnx.Variable(jnp.full(3, 2.0), scale=1.0)
  for _ in range(2):  # the first follows the replacement; the second passes the guard past it
    np.testing.assert_allclose(f(x), eager(x), rtol=1e-6)
  for model in (ours, eager):
    model.h.set_metadata(scale=4.0)
  for _ in range(20):
    nnx.update(elsewhere, nnx.state(elsewhere))  # edits of another model's nodes
  np.testing.assert_allclose(f(x), eager(x), rtol=1e-6)


def test_a_static_argument_equal_to_the_last_one_stays_on_the_warm_path(monkeypatch):
  """A static argument is matched by value, as jax.jit matches it: an equal tuple built anew for
  each call takes the warm path, and a different one gives its own values."""
  from brainnx._engine import jitted

  w = nnx.Param(jnp.arange(3.0))
  f = bnx.jit(lambda x, shape: (x * w[...]).reshape(shape), static_argnums=1)
  x = jnp.ones(3)
  f(x, tuple([3, 1]))
  cold = []
  real = jitted.JittedFunction._cold_call
  monkeypatch.setattr(jitted.JittedFunction, '_cold_call', lambda self, *a: cold.append(1) or real(self, *a))
  for _ in range(3):
    np.testing.assert_array_equal(f(x, tuple([3, 1])), jnp.arange(3.0).reshape(3, 1))
  assert cold == []
  np.testing.assert_array_equal(f(x, (1, 3)), jnp.arange(3.0).reshape(1, 3))
  assert cold == [1]


def test_an_edit_of_a_guarded_object_is_seen_among_edits_elsewhere_and_past_the_log():
  model = MLP(2, 8, 1, rngs=nnx.Rngs(0))
  f = bnx.jit(lambda x: model(x))
  x = jnp.ones((3, 2))
  f(x)
  f(x)  # warm: the guard has passed once
  for flood in (3, _compat.EDIT_LOG.maxlen + 10):
    model.l2 = nnx.Linear(8, 1, rngs=nnx.Rngs(flood))  # ours: the call must see the new layer
    for _ in range(flood):  # then edits of other objects, past the log's reach the second time
      nnx.Dict(a=1).b = 2
    np.testing.assert_allclose(f(x), model(x), rtol=1e-6)  # the old layer would give other values
    f(x)  # the new discovery's guard passes once: the next round starts from a mark


# -- issue 49: what a warm call must notice (each against the eager computation) --------------

def test_a_flax_write_reaches_every_warm_function_over_the_variable():
  """Two warm functions keep value lists holding the same Variable: one set_value reaches both."""
  w = nnx.Param(jnp.ones(3))
  f, g = bnx.jit(lambda x: x * w[...]), bnx.jit(lambda x: x + w[...])
  x = jnp.arange(3.0)
  for _ in range(2):
    f(x), g(x)
  w.set_value(jnp.full(3, 5.0))
  np.testing.assert_allclose(g(x), x + 5.0)
  np.testing.assert_allclose(f(x), x * 5.0)
  w[...] = jnp.full(3, 7.0)
  np.testing.assert_allclose(f(x), x * 7.0)
  np.testing.assert_allclose(g(x), x + 7.0)


@pytest.mark.parametrize('route', ['update_from_state', 'copy_from'])
def test_metadata_replaced_by_flax_routes_retraces_a_warm_call(route):
  """A trace that read a Variable's metadata is not reused after update_from_state or copy_from
  gave it other metadata."""
  w = nnx.Param(jnp.ones(2), scale=2.0)
  f = bnx.jit(lambda x: x * w[...] * w.get_metadata()['scale'])
  x = jnp.arange(2.0)
  f(x), f(x)
  other = nnx.Param(jnp.ones(2), scale=10.0)
  getattr(w, route)(other)
  np.testing.assert_allclose(f(x), x * 10.0)  # eager: x * 1 * 10


def test_a_plain_dict_that_gains_an_entry_is_seen():
  params = {'a': nnx.Param(jnp.ones(2))}
  f = bnx.jit(lambda x: x + sum(v[...] for v in params.values()))
  x = jnp.zeros(2)
  f(x), f(x)
  params['b'] = nnx.Param(jnp.full(2, 3.0))
  np.testing.assert_allclose(f(x), jnp.full(2, 4.0))


def test_an_attachment_written_by_another_warm_call_is_seen():
  """f attaches a new Variable to the model on every call; once warm, that write is brainnx's
  own (no flax edit logs it). g, warm over the same model, reads every Variable of it and sees
  each new one."""
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  traces = []

  def attach(x):
    traces.append(1)
    model.h = nnx.Intermediate(x * 2)
    return x

  def total():
    return sum(v[...].sum() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable))

  f, g = bnx.jit(attach), bnx.jit(total)
  for _ in range(4):
    f(jnp.ones(2)), g()
  before = len(traces)
  for k in range(2, 5):
    f(jnp.ones(2) * k)
    np.testing.assert_allclose(g(), total(), rtol=1e-6)  # eager: kernel + bias + h (4k)
  assert len(traces) == before  # f stayed warm: its attach was brainnx's write alone


def test_a_keyword_argument_added_to_a_warm_call_is_used():
  f = bnx.jit(lambda x, scale=1.0: x * scale)
  x = jnp.arange(3.0)
  f(x), f(x)
  np.testing.assert_allclose(f(x, scale=2.0), x * 2.0)
  np.testing.assert_allclose(f(x), x)


def test_a_variable_passed_where_an_array_was_is_not_sent_to_the_array_program():
  def f(a):
    if isinstance(a, nnx.Variable):
      a[...] = a[...] + 1  # a write: the array program cannot do it
      return a[...]
    return a * 2

  jitted, x = bnx.jit(f), jnp.arange(3.0)
  jitted(x), jitted(x)
  v = nnx.Variable(jnp.arange(3.0))
  np.testing.assert_allclose(jitted(v), x + 1)
  np.testing.assert_allclose(v[...], x + 1)


class _Scaled(nnx.Module):
  def __init__(self):
    self.scale = jnp.ones(2)  # an array attribute: state, as nnx.split sees it

  def __call__(self, x):
    return x * self.scale


def test_an_array_attribute_set_between_warm_calls_is_read():
  model = _Scaled()
  f = bnx.jit(lambda x: model(x))
  x = jnp.arange(2.0)
  f(x), f(x)
  model.scale = jnp.full(2, 3.0)
  np.testing.assert_allclose(f(x), x * 3.0)


def test_a_variable_attached_by_a_warm_brainnx_write_is_seen_by_another_warm_function():
  """``F`` attaches a new Variable to ``m`` through brainnx's own warm write (an edit whose owner
  the log does not know); ``G``, warm over ``m.h``, reads the new Variable on its next call, as
  eager Python does."""

  class M(nnx.Module):
    def __init__(self):
      self.h = nnx.Variable(jnp.zeros(3))

  m = M()

  def attach(x):
    m.h = nnx.Variable(x)

  F, G = bnx.jit(attach), bnx.jit(lambda: m.h[...] * 1)
  x = jnp.ones(3)
  F(x)
  F(x)
  G()
  G()
  F(x * 2.0)
  np.testing.assert_array_equal(G(), x * 2.0)  # eager: m.h[...] * 1 after attach(x * 2.0)
