"""Stacked Variables remember their axis: broadcasting a stack into a call of its size is refused.

Oracles: a Python loop over members on plain arrays, and flax's own ``nnx.vmap``.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import brainnx as bnx
from brainnx._engine.filters import Stacked
from helpers import assert_oracle_close, assert_same_values, values_of

X = jnp.asarray(np.random.default_rng(0).normal(size=4), jnp.float32)


class Scale(nnx.Variable):
  """A shared, broadcast factor (not a Param)."""


def _square(n=4, seed=0):
  rngs = nnx.Rngs(seed)
  return bnx.vmap(lambda: nnx.Linear(4, 4, use_bias=False, rngs=rngs), axis_size=n)()


def _loop(model, x):
  """The oracle: each member on its own, as plain arrays."""
  return np.stack([np.asarray(x @ model.kernel[i]) for i in range(model.kernel.shape[0])])


# -- the record --------------------------------------------------------------------


def test_vmap_records_axis_and_size_and_flax_keeps_it():
  model = _square()
  assert model.kernel.stacked == Stacked(axis=0, size=4, ndim=3)
  graphdef, state = nnx.split(model)
  assert nnx.merge(graphdef, state).kernel.stacked == model.kernel.stacked
  assert nnx.clone(model).kernel.stacked == model.kernel.stacked
  assert nnx.state(model)['kernel'].get_metadata()['stacked'] == model.kernel.stacked
  rngs = nnx.Rngs(1)
  sideways = bnx.vmap(lambda: nnx.Linear(2, 3, rngs=rngs), axis_size=5, out_axes=1)()
  assert sideways.kernel.shape == (2, 5, 3) and sideways.kernel.stacked == Stacked(1, 5, 3)
  # an optimizer built from the stack is stacked too: flax copies the metadata to its moments
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  moments = [v for _, v in nnx.to_flat_state(nnx.state(opt, nnx.OptState)) if jnp.ndim(v.get_value()) == 3]
  assert moments and all(v.stacked == Stacked(0, 4, 3) for v in moments)


def test_vmap_new_states_records_its_new_variables():
  cell = nnx.Dict(w=nnx.Param(jnp.ones(2)))

  @bnx.vmap_new_states
  def init(x):
    cell['h'] = nnx.Variable(x * cell['w'][...])

  init(jnp.ones((3, 2)))
  assert cell['h'].stacked == Stacked(0, 3, 2)
  assert getattr(cell['w'], 'stacked', None) is None  # existing, broadcast: not stacked


def test_a_shared_copy_is_not_recorded():
  rngs = nnx.Rngs(0)
  made = bnx.vmap(lambda: nnx.Linear(2, 2, rngs=rngs), axis_size=3, state_out_axes={None: nnx.PathContains('bias')})()
  assert made.bias.shape == (2,) and 'stacked' not in made.bias.get_metadata()
  assert made.kernel.stacked == Stacked(0, 3, 3)


# -- vmap ------------------------------------------------------------------------


def test_issue_reproducer_raises_and_the_named_fix_equals_a_loop_over_members():
  model = _square()
  before = values_of(model)
  with pytest.raises(
    bnx.BatchAxisError,
    match=r"Param at \('model', 'kernel'\) is stacked \(axis 0, 4 members.*size 4.*state_in_axes=\{0: nnx\.Param\}",
  ):
    bnx.vmap(lambda: model(X), axis_size=4)()
  assert_same_values(before, values_of(model))
  got = bnx.vmap(lambda: model(X), axis_size=4, state_in_axes={0: nnx.Param})()
  np.testing.assert_allclose(got, _loop(model, X), rtol=1e-6)
  flax = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model, X)
  np.testing.assert_allclose(got, flax, rtol=1e-6)


def test_non_square_stack_gets_the_same_error_not_a_shape_error():
  rngs = nnx.Rngs(0)
  model = bnx.vmap(lambda: nnx.Linear(4, 3, rngs=rngs), axis_size=5)()
  with pytest.raises(bnx.BatchAxisError, match=r"Param at \('model', '(bias|kernel)'\) \(and Param at .*size 5"):
    bnx.vmap(lambda x: model(x), in_axes=None, axis_size=5)(X)


def test_a_long_list_of_stacked_variables_is_cut_in_the_message():
  """Twelve stacked Variables broadcast: the message names the first five and counts the rest."""
  rngs = nnx.Rngs(0)
  model = bnx.vmap(lambda: nnx.Sequential(*[nnx.Linear(4, 4, rngs=rngs) for _ in range(6)]), axis_size=4)()
  with pytest.raises(bnx.BatchAxisError, match=r"is stacked") as info:
    bnx.vmap(lambda: model(X), axis_size=4)()
  message = str(info.value)
  assert 'and 7 more' in message, message
  assert message.count('Param at') == 5, message
  got = bnx.vmap(lambda: model(X), axis_size=4, state_in_axes={0: nnx.Param})()
  flax = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model, X)
  np.testing.assert_allclose(got, flax, rtol=1e-6)


def test_in_axes_none_on_the_module_argument_raises_and_names_the_argument():
  model = _square()
  with pytest.raises(bnx.BatchAxisError, match=r"in_axes=None for argument 0.*state_in_axes=\{0: nnx\.Param\}, or pass in_axes=0 for argument 0"):
    bnx.vmap(lambda m: m(X), in_axes=None, axis_size=4)(model)
  got = bnx.vmap(lambda m: m(X), in_axes=0)(model)
  np.testing.assert_allclose(got, _loop(model, X), rtol=1e-6)


def test_a_filter_matching_nothing_is_named_with_a_real_filter():
  model = _square()
  with pytest.raises(ValueError, match=r"state_in_axes entry \{0: 'params'\} matches none of the Variables.*Param at \('model', 'kernel'\).*state_in_axes=\{0: nnx\.Param\}.*is a tag"):
    bnx.vmap(lambda: model(X), axis_size=4, state_in_axes='params')()
  with pytest.raises(ValueError, match=r"state_in_axes entry \{None: nnx\.BatchStat\} matches none"):
    bnx.vmap(lambda: model(X), axis_size=4, state_in_axes={0: nnx.Param, None: nnx.BatchStat})()
  with pytest.raises(ValueError, match=r"state_out_axes entry \{0: nnx\.BatchStat\} matches none of the Variables the function reaches or creates"):
    bnx.vmap(lambda: model(X), state_in_axes=nnx.Param, state_out_axes={0: nnx.BatchStat})()


def test_state_out_axes_may_match_only_created_variables():
  rngs = nnx.Rngs(0)
  made = bnx.vmap(lambda: nnx.BatchNorm(3, rngs=rngs), axis_size=2, state_out_axes={None: nnx.BatchStat})()
  assert made.mean.shape == (3,) and made.scale.shape == (2, 3)


def test_a_rule_for_other_variables_keeps_them_and_shows_the_whole_line():
  model = _square()
  scale = Scale(jnp.float32(2.0))
  with pytest.raises(bnx.BatchAxisError, match=r"state_in_axes=\{None: Scale, 0: nnx\.Param\}"):
    bnx.vmap(lambda: model(X) * scale[...], axis_size=4, state_in_axes={None: Scale})()
  got = bnx.vmap(lambda: model(X) * scale[...], axis_size=4, state_in_axes={None: Scale, 0: nnx.Param})()
  np.testing.assert_allclose(got, 2.0 * _loop(model, X), rtol=1e-6)


def test_explicit_broadcast_gives_every_element_the_whole_stack():
  model = _square()
  got = bnx.vmap(lambda x: model(x), state_in_axes={None: nnx.Param})(jnp.stack([X, 2 * X, 3 * X, 4 * X]))
  whole = np.tensordot(np.asarray(X), np.asarray(model.kernel[...]), axes=(0, 0))  # nnx.Linear on the whole (4, 4, 4) stack
  np.testing.assert_allclose(got, np.stack([whole * k for k in (1, 2, 3, 4)]), rtol=1e-5)


def test_another_size_is_not_this_stack_and_broadcasts_as_before():
  model = _square()
  got = bnx.vmap(lambda s: model(X) * s)(jnp.arange(3.0))
  whole = np.tensordot(np.asarray(X), np.asarray(model.kernel[...]), axes=(0, 0))  # nnx.Linear on the whole (4, 4, 4) stack
  np.testing.assert_allclose(got, np.stack([whole * s for s in range(3)]), rtol=1e-5)


def test_a_member_inside_the_map_is_not_taken_for_the_stack():
  """Inside a call mapped over members each sees its own (4, 4) kernel; an inner vmap of size 4
  broadcasting it is fine (the record's rank no longer matches)."""
  model = _square()
  xs = jnp.asarray(np.random.default_rng(1).normal(size=(4, 4)), jnp.float32)
  got = bnx.vmap(lambda: bnx.vmap(lambda x: model(x))(xs), axis_size=4, state_in_axes={0: nnx.Param})()
  want = np.stack([np.asarray(xs @ model.kernel[i]) for i in range(4)])
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_stacked_dropout_streams_are_named_with_rng_state():
  rngs = nnx.Rngs(0, dropout=1)

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.lin(x))

  net = bnx.vmap(lambda: Net(rngs), axis_size=3)()
  with pytest.raises(bnx.BatchAxisError, match=r"state_in_axes=\{0: \(nnx\.RngState, nnx\.Param\)\}|state_in_axes=\{0: \(nnx\.Param, nnx\.RngState\)\}"):
    bnx.vmap(lambda: net(X), axis_size=3)()
  out = bnx.vmap(lambda: net(X), axis_size=3, state_in_axes={0: (nnx.Param, nnx.RngState)})()
  assert out.shape == (3, 4)


# -- scan over layers ----------------------------------------------------------------


def _layers(n=4, din=4, dout=4, seed=0):
  rngs = nnx.Rngs(seed)
  return bnx.vmap(lambda: nnx.Linear(din, dout, rngs=rngs), axis_size=n)()


def _through(stack, h):
  for i in range(stack.kernel.shape[0]):
    h = np.tanh(h @ np.asarray(stack.kernel[i]) + np.asarray(stack.bias[i]))
  return h


def test_scan_over_layers_without_state_in_axes_raises_and_the_fix_equals_a_loop():
  stack = _layers()
  body = lambda h, _: (jnp.tanh(stack(h)), None)  # noqa: E731
  before = values_of(stack)
  with pytest.raises(bnx.BatchAxisError, match=r"scan: Param at \('stack', '(bias|kernel)'\).*4 members.*runs 4 steps.*state_in_axes=\{0: nnx\.Param\}"):
    bnx.scan(body, X, None, length=4)
  assert_same_values(before, values_of(stack))
  got = bnx.scan(body, X, None, state_in_axes={0: nnx.Param})[0]
  assert_oracle_close(got, _through(stack, np.asarray(X)))


def test_scan_reading_the_whole_stack_without_a_shape_error_also_raises():
  stack = _layers()
  with pytest.raises(bnx.BatchAxisError, match=r"every step reads the whole stack\. To scan"):
    bnx.scan(lambda c, x: (c + stack.kernel[...].sum() * x, None), 0.0, jnp.ones(4))
  with pytest.raises(bnx.BatchAxisError, match=r"for_loop: Param at \('stack', 'kernel'\) is stacked"):
    bnx.for_loop(lambda x: stack.kernel[...].sum() * x, jnp.ones(4))
  # held fixed on purpose: every step sees the whole stack
  got = bnx.scan(lambda c, x: (c + stack.kernel[...].sum() * x, None), 0.0, jnp.ones(4), state_in_axes={None: nnx.Param})[0]
  np.testing.assert_allclose(got, 4 * float(np.asarray(stack.kernel[...]).sum()), rtol=1e-5)
  # another length is not this stack
  got = bnx.scan(lambda c, x: (c + stack.kernel[...].sum() * x, None), 0.0, jnp.ones(3))[0]
  np.testing.assert_allclose(got, 3 * float(np.asarray(stack.kernel[...]).sum()), rtol=1e-5)


def test_scan_filter_matching_nothing_is_named():
  stack = _layers()
  with pytest.raises(ValueError, match=r"scan: state_in_axes entry \{0: 'params'\} matches none of the Variables the body reaches"):
    bnx.scan(lambda h, _: (stack(h), None), X, None, state_in_axes='params')
  with pytest.raises(ValueError, match=r"for_loop: state_in_axes entry \{0: 'params'\} matches none of the Variables"):
    bnx.for_loop(lambda: stack.kernel[...].sum(), state_in_axes='params')


def test_training_an_ensemble_step_by_step_is_not_a_scan_over_layers():
  """A scan of 4 steps writing a 4-member ensemble carries it: no error, and it equals a loop."""
  model = _square()
  kernels = np.asarray(model.kernel[...]).copy()

  def step(_, x):
    def member_loss():
      return (model(x) ** 2).sum()

    grads = bnx.vmap(lambda: bnx.grad(member_loss, grad_states=nnx.Param)(), axis_size=4, state_in_axes={0: nnx.Param})()
    model.kernel[...] -= 0.1 * grads['model']['kernel'][...]
    return None, None

  xs = jnp.asarray(np.random.default_rng(2).normal(size=(4, 4)), jnp.float32)
  bnx.scan(step, None, xs)
  for x in np.asarray(xs):  # the oracle: plain gradient steps per member
    kernels = kernels - 0.1 * 2 * x[None, :, None] * (x @ kernels)[:, None, :]
  np.testing.assert_allclose(model.kernel[...], kernels, rtol=1e-4, atol=1e-6)


def test_fori_loop_over_steps_is_never_taken_for_layers():
  stack = _layers()
  got = bnx.fori_loop(0, 4, lambda i, c: c + stack.kernel[...].sum(), 0.0)
  np.testing.assert_allclose(got, 4 * float(np.asarray(stack.kernel[...]).sum()), rtol=1e-5)


def test_map_never_slices_variables_so_it_does_not_check():
  """bnx.map over as many inputs as members, handing the whole ensemble to an inner vmap over
  members: meant, and equal to a Python loop; a plain vmap of that size must say so."""
  model = _square()
  forward = lambda x: bnx.vmap(lambda: model(x), axis_size=4, state_in_axes={0: nnx.Param})().mean(0)  # noqa: E731
  xs = jnp.asarray(np.random.default_rng(3).normal(size=(4, 4)), jnp.float32)
  want = np.stack([_loop(model, x).mean(0) for x in np.asarray(xs)])
  np.testing.assert_allclose(bnx.map(forward, xs), want, rtol=1e-5)
  np.testing.assert_allclose(bnx.map(forward, jnp.concatenate([xs, xs]), batch_size=4), np.concatenate([want, want]), rtol=1e-5)
  with pytest.raises(bnx.BatchAxisError, match=r"state_in_axes=\{None: nnx\.Param\}"):
    bnx.vmap(forward)(xs)
  np.testing.assert_allclose(bnx.vmap(forward, state_in_axes={None: nnx.Param})(xs), want, rtol=1e-5)


def test_scan_reads_state_axes_and_refuses_carry_with_the_rewrite():
  stack = _layers()
  got = bnx.scan(lambda h, _: (jnp.tanh(stack(h)), None), X, None, state_in_axes=nnx.StateAxes({nnx.Param: 0}))[0]
  assert_oracle_close(got, _through(stack, np.asarray(X)))
  with pytest.raises(TypeError, match=r"StateAxes entry \{\.\.\.: nnx\.Carry\}.*state_in_axes=\{0: nnx\.Param\}"):
    bnx.scan(lambda h, _: (stack(h), None), X, None, state_in_axes=nnx.StateAxes({nnx.Param: 0, ...: nnx.Carry}))
