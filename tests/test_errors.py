"""Bad inputs not covered elsewhere: each gets a clear error naming what is wrong."""

import jax
import jax.numpy as jnp
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
  with pytest.raises(ValueError, match=r"inconsistent batch sizes \[2, 3, 4\] \(Param at \(0, 'l1', 'bias'\): 4, Param at \(0, 'l1', 'kernel'\): 3.*Pass in_axes=None"):
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


