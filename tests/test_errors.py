"""Bad inputs not covered elsewhere: each gets a clear error naming what is wrong."""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import MLP


def test_leaked_tracer_in_a_variable_is_named():
  v = nnx.Variable(jnp.zeros(2))
  leaked = []
  checking = jax.config.jax_check_tracer_leaks
  jax.config.update('jax_check_tracer_leaks', False)  # this leak is deliberate
  try:
    jax.jit(lambda x: leaked.append(x) or x)(jnp.ones(2))
  finally:
    jax.config.update('jax_check_tracer_leaks', checking)
  v.set_raw_value(leaked[0])  # what a buggy raw transform would leave behind
  with pytest.raises(RuntimeError, match=r"Variable at \('v',\) holds a leaked tracer"):
    bnx.jit(lambda: v[...] + 1)()


def test_grad_argnums_out_of_range():
  with pytest.raises(ValueError, match=r'grad: argnums=2 is out of range: the function got 1 positional argument'):
    bnx.grad(lambda x: x.sum(), argnums=2)(jnp.ones(2))


def test_grad_not_callable():
  with pytest.raises(TypeError, match='callable'):
    bnx.grad(3)
  with pytest.raises(TypeError, match='callable'):
    bnx.value_and_grad('f')


def test_vmap_out_axes_none_for_a_batched_output():
  with pytest.raises(ValueError, match='out_axes=None but depends on the batch'):
    bnx.vmap(lambda x: x * 2, out_axes=None)(jnp.ones((3, 2)))
  out = bnx.vmap(lambda x: jnp.ones(2), out_axes=None)(jnp.ones((3, 2)))
  assert out.shape == (2,)


def test_vmap_and_pmap_not_callable():
  for transform in (bnx.vmap, bnx.pmap, bnx.vmap_new_states):
    with pytest.raises(TypeError, match='callable'):
      transform(1)


def test_while_loop_bad_cond_and_body():
  with pytest.raises(TypeError, match='boolean scalar'):
    bnx.while_loop(lambda x: x, lambda x: x + 1, 0.0)
  with pytest.raises(ValueError, match='structure of init_val'):
    bnx.while_loop(lambda x: x < 3, lambda x: (x, x), 0)
  with pytest.raises(TypeError, match='callable'):
    bnx.while_loop(1, lambda x: x, 0)


def test_module_argument_axis_errors_name_the_argument():
  model = MLP(3, 4, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"inconsistent batch sizes \[2, 3, 4\] \(size 4: 2 Variables \(first: Param at \(0, 'l1', 'bias'\)\); size 3: Param at \(0, 'l1', 'kernel'\).*Pass in_axes=None"):
    bnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model, jnp.ones((5, 3)))


def test_mutable_array_variables_are_refused_clearly():
  v = nnx.Variable(jnp.zeros(2), ref=True)
  with pytest.raises(TypeError, match=r"Variable at \('v',\) was created with hijax=True or ref=True"):
    bnx.jit(lambda: v[...] + 1)()


# -- Variables holding values that are not arrays ----------------------------------------------------

def test_jit_reads_str_variable():
  """Reading a Variable that holds a str inside jit raises TypeError naming the Variable."""
  label_var = nnx.Variable('hello')
  f = bnx.jit(lambda x: x * len(label_var.get_value()))
  with pytest.raises(TypeError, match=r"Variable at \('label_var',\) holds a str \('hello'\), not an array"):
    f(jnp.ones(2))


def test_jit_reads_object_variable():
  """Reading a Variable that holds an arbitrary object inside jit raises TypeError naming it."""
  obj_var = nnx.Variable(object())
  f = bnx.jit(lambda x: x if obj_var.get_value() is not None else -x)
  with pytest.raises(TypeError, match=r"Variable at \('obj_var',\) holds a object \(<object object at 0x[0-9a-f]+>\), not an array"):
    f(jnp.ones(2))


# -- hints a first hour meets: each pasted as it is printed, and run ---------------------------

def _ensemble(members=4):
  rngs = nnx.Rngs(0)
  return bnx.vmap(lambda: nnx.Linear(3, 2, rngs=rngs), axis_size=members)()


def _members(model, members=4):
  graphdef, state = nnx.split(model)
  return [nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], state)) for k in range(members)]


def test_data_arguments_of_another_size_get_the_in_axes_that_broadcasts_them():
  """An ensemble of 4 called on a batch of 16 with the default in_axes=0: the hint names the
  data arguments (not the Module) and spells the in_axes; pasted, it gives each member's loss."""
  ensemble = _ensemble()
  x, y = jnp.linspace(-1, 1, 48).reshape(16, 3), jnp.ones((16, 2))

  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  with pytest.raises(ValueError, match=r'inconsistent batch sizes \[4, 16\] \(size 4: 2 Variables .*; size 16: argument 1, argument 2\)') as error:
    bnx.vmap(loss)(ensemble, x, y)
  message = str(error.value)
  assert 'Pass in_axes=None for it' not in message  # not the Module's axis
  hinted = re.search(r'in_axes=(\(.*\))$', message).group(1)
  assert hinted == '(0, None, None)'
  got = bnx.vmap(loss, in_axes=eval(hinted))(ensemble, x, y)
  np.testing.assert_allclose(got, [loss(m, x, y) for m in _members(ensemble)], rtol=1e-6)


def test_a_stack_used_as_one_model_is_named_with_the_way_to_map_it():
  """flax's own shape error stays; a note says the model is a stack and how to call it."""
  ensemble = _ensemble()
  x = jnp.linspace(-1, 1, 48).reshape(16, 3)
  for transform in (bnx.jit, bnx.grad):
    with pytest.raises(TypeError, match='dot_general requires contracting dimensions') as error:
      transform(lambda m, x: m(x).sum())(ensemble, x)
    note = error.value.__notes__[0]
    assert note.startswith("brainnx: Param at (0, 'bias') and 1 more Variables hold a stack of 4 members")
    assert 'state_in_axes={0: nnx.Param}' in note
  # the two ways the note gives, run: under vmap, and one member taken out
  mapped = bnx.vmap(lambda x: ensemble(x), in_axes=None, axis_size=4, state_in_axes={0: nnx.Param})(x)
  graphdef, state = nnx.split(ensemble)
  second = nnx.merge(graphdef, jax.tree.map(lambda a: a[1], state))
  np.testing.assert_allclose(mapped[1], second(x), rtol=1e-6)
  np.testing.assert_allclose(mapped, jnp.stack([m(x) for m in _members(ensemble)]), rtol=1e-6)


def test_scanning_over_a_python_list_says_what_was_passed():
  add = lambda c, x: (c + x, c)  # noqa: E731
  with pytest.raises(ValueError, match=r'scan got xs as a Python list of 3 scalars.*jnp\.asarray\(xs\)'):
    bnx.scan(add, 0.0, [1.0, 2.0, 3.0])
  carry, _ = bnx.scan(add, 0.0, jnp.asarray([1.0, 2.0, 3.0]))  # the fix, pasted
  assert float(carry) == 6.0  # the oracle: sum([1, 2, 3])
  rows = [jnp.full(2, float(k)) for k in range(3)]
  with pytest.raises(TypeError, match="unsupported operand") as error:
    bnx.scan(add, jnp.zeros(2), rows)
  assert 'each step gets a list of 3 rows' in error.value.__notes__[0] and 'jnp.stack(xs)' in error.value.__notes__[0]
  carry, _ = bnx.scan(add, jnp.zeros(2), jnp.stack(rows))
  np.testing.assert_allclose(carry, sum(rows))


# -- issue 57: messages that name the argument and the fix -----------------------------------------

@pytest.mark.parametrize('loop', ['scan', 'for_loop'])
def test_a_python_list_of_scalars_is_named_with_the_fix_by_every_loop(loop):
  run = {'scan': lambda: bnx.scan(lambda c, x: (c + x, None), 0.0, [1.0, 2.0]),
         'for_loop': lambda: bnx.for_loop(lambda x: x * 2.0, [1.0, 2.0])}[loop]
  with pytest.raises(ValueError, match=rf'{loop} got xs as a Python list of 2 scalars.*jnp.asarray\(xs\)'):
    run()


@pytest.mark.parametrize('loop', ['scan', 'for_loop'])
def test_a_body_calling_an_array_method_on_a_list_of_rows_gets_the_stack_hint(loop):
  xs = [jnp.ones(3), jnp.ones(3)]
  run = {'scan': lambda: bnx.scan(lambda c, x: (c + x.sum(), None), 0.0, xs),
         'for_loop': lambda: bnx.for_loop(lambda x: x.sum(), xs)}[loop]
  with pytest.raises(AttributeError, match="'list' object has no attribute 'sum'") as e:
    run()
  assert any('stack them: jnp.stack(xs)' in note for note in e.value.__notes__)


def test_grad_of_a_module_names_grad_and_the_loss_to_write():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r'^grad: Gradient only defined for scalar-output functions.*Linear Module itself'
                     r'.*bnx.grad\(lambda x: loss\(model\(x\)\), grad_states=model\)'):
    bnx.grad(model)(jnp.ones(3))
  with pytest.raises(TypeError, match=r'^value_and_grad: .*Return a scalar'):
    bnx.value_and_grad(lambda x: x * 2.0)(jnp.ones(3))


def test_a_module_given_as_the_scan_body_is_explained_with_the_wrap_to_write():
  model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r'model\(carry, x\)') as e:  # pytest matches the notes too
    bnx.scan(model, jnp.zeros(3), jnp.ones((2, 3)))
  note = next(n for n in e.value.__notes__ if n.startswith('brainnx:'))
  assert 'model(carry, x)' in note and 'bnx.scan(lambda carry, x: (model(carry), None), init, xs)' in note
  # the wrap it names runs, and equals a Python loop over the steps (the oracle)
  out, _ = bnx.scan(lambda carry, x: (model(carry), None), jnp.zeros(3), jnp.ones((2, 3)))
  np.testing.assert_allclose(np.asarray(out), np.asarray(model(model(jnp.zeros(3)))), rtol=1e-6)


def test_a_loop_body_taking_too_few_arguments_is_refused_before_tracing():
  with pytest.raises(TypeError, match=r'scan calls its function as f\(carry, x\), 2 positional argument\(s\)'):
    bnx.scan(lambda c: (c, None), 0.0, jnp.ones(2))


class _Bodies:
  def two(self, c, x):
    return c, x

  def needs_keyword(self, c, x, *, k):
    return c, x


_BODIES = {
  'two': lambda c, x: (c, x), 'one': lambda c: (c, None), 'three': lambda c, x, y: (c, x),
  'a default': lambda c, x, y=1: (c, x), 'varargs': lambda *a: (a[0], a[1]), 'one and varargs': lambda c, *a: (c, a[0]),
  'keyword-only': lambda c, x, *, k: (c, x), 'keyword-only default': lambda c, x, *, k=1: (c, x),
  'bound method': _Bodies().two, 'bound method, keyword-only': _Bodies().needs_keyword,
  'partial': functools.partial(lambda a, c, x: (c, x), 1), 'partial too many': functools.partial(lambda a, c: (c, None), 1),
}


@pytest.mark.parametrize('name', list(_BODIES))
def test_the_arity_check_refuses_exactly_what_python_cannot_call(name):
  """Oracle: whether ``inspect.signature(f).bind(carry, x)`` succeeds (the fast check reads the
  code object; it must agree for every kind of callable)."""
  f = _BODIES[name]
  try:
    inspect.signature(f).bind(None, None)
    binds = True
  except TypeError:
    binds = False
  if binds:
    carry, ys = bnx.scan(f, jnp.zeros(()), jnp.ones(2))
    assert carry.shape == ()
  else:
    with pytest.raises(TypeError, match=r'scan calls its function as f\(carry, x\), 2 positional argument\(s\)'):
      bnx.scan(f, jnp.zeros(()), jnp.ones(2))


def test_a_module_given_as_the_for_loop_body_is_explained_and_its_arguments_are_not_taken_for_a_list():
  model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  xs = jnp.ones((2, 3))
  with pytest.raises(TypeError, match=r'model\(\*x\)') as e:  # two positional arguments: f(x_row, x_row)
    bnx.for_loop(model, xs, xs)
  notes = [n for n in e.value.__notes__ if n.startswith('brainnx:')]
  assert len(notes) == 1 and 'bnx.for_loop(lambda x: model(x), xs)' in notes[0]
  # the wrap it names runs, and equals a Python loop over the rows (the oracle)
  np.testing.assert_allclose(np.asarray(bnx.for_loop(lambda x: model(x), xs)), np.stack([model(r) for r in xs]), rtol=1e-6)
