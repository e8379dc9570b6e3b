"""brainnx against its oracles on generated programs (see ``differential.py``): the bounded
profile here, the long one in ``benchmarks/differential_long.py``; then the programs the
generator shrank to while it found defects, kept as explicit regression cases."""

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings

from differential import Program, WorldSpec, check, programs, VOCABULARY

# the default profile draws 200 programs (about 20 s on one core); HYPOTHESIS_PROFILE=long
# as many as benchmarks/differential_long.py asks
EXAMPLES = {'dev': 20, 'default': 200}.get(os.environ.get('HYPOTHESIS_PROFILE', 'default'), 200)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
@given(programs())
def test_generated_programs_equal_their_oracle(program):
  check(program)


def _body(*sources):
  index = {s.source: i for i, s in enumerate(VOCABULARY)}
  return tuple(index[s] for s in sources)


ALL = WorldSpec(layers=True, tree=True, shared=True, empty_cache=True, empty_list=True, rngs=True)

# the defects programs written outside the suite found, as the generator draws them
REGRESSIONS = {
  'a Variable replaced on every call, then set from outside': Program(
    ALL, _body('m.h = nnx.Variable(m.h[...] * 0.5 + acc)', 'acc = acc + m.w[...]'), 'acc', 'closure', 'jit',
    (None, None, 'set h', None)),
  'a dict empty at the first trace, filled on first use': Program(
    ALL, _body("if 'z' not in m.cache:\n  m.cache['z'] = nnx.Cache(jnp.zeros(3))\nm.cache['z'][...] += acc"),
    'acc', 'trainer', 'jit', (None, None, None)),
  'a Module appended to an empty list': Program(
    ALL, _body('if len(m.items) < 2:\n  m.items.append(nnx.Param(jnp.ones(3)))\nacc = acc + m.items[-1][...]'),
    'acc', 'arg', 'jit', (None, 'fill')),
  'a created node holding a pytree-valued Variable': Program(
    ALL, _body('acc = acc + m.w[...]'), 'created', 'global', 'jit', (None,)),
  'two sows popped': Program(
    ALL, _body("m.sow(nnx.Intermediate, 's', acc)", 'acc = jnp.tanh(acc)', "m.sow(nnx.Intermediate, 's', acc)"),
    'popped', 'method', 'jit', (None,)),
  'a global read in a method of a Module reached as data': Program(
    ALL, _body('acc = m.scaled(acc)', 'G[...] = G[...] - 0.5'), 'acc', 'closure', 'for_loop', ('GSCALE',)),
  'a constant written inside grad': Program(
    ALL, _body('m.c.set_value(jnp.array(-1.0))', 'acc = acc + m.w[...]'), 'acc', 'arg', 'grad', ('replace', None)),
  'a batched write into a broadcast Variable is refused and rolled back': Program(
    ALL, _body('m.c[...] = m.c[...] + 1.0', 'm.w[...] = m.w[...] * 0.5 + acc'), 'acc', 'closure', 'vmap', (None,)),
  'a pytree-valued Variable written under eval_shape is left alone': Program(
    ALL, _body("m.t.set_value({'k': m.t['k'] * 2.0, 'j': (m.t['j'][0] + 1.0, m.t['j'][1] - 1.0)})"), 'created',
    'closure', 'eval_shape', ('nnx.update',)),
  # issue 55: the outside programs' shapes
  'an instance in grad_states replaced by a new Param between calls': Program(
    ALL, _body('acc = acc + m.w[...]', 'acc = jnp.tanh(acc)'), 'acc', 'closure', 'grad_states', (None, 'replace', None)),
  'a stack beside the mapped state, reached and not read': Program(
    dataclasses.replace(ALL, stack=True), _body('acc = acc + m.w[...]', 'm.h = nnx.Variable(acc * 0.5)'),
    'acc', 'closure', 'vmap_new_states', (None, None)),
  'the model read through an object of a class made by exec': Program(
    ALL, _body('acc = acc * m.c[...] + 1.0', 'm.c[...] = m.c[...] + 1.0'), 'acc', 'exec trainer', 'jit',
    (None, 'set_value')),
  'a holder rebound to a model of the same structure': Program(
    ALL, _body('acc = acc + m.w[...]', 'm.w[...] = m.w[...] * 0.9'), 'acc', 'trainer', 'jit(grad_states)',
    (None, 'rebind', None)),
  'an attribute that shared a Variable rebound to the new one, warm': Program(
    ALL, _body('acc = acc - m.alias[...]', 'm.held = m.w\nacc = acc + m.held[...]'), 'acc', 'method', 'jit(fori_loop)',
    ('replace', None, None)),
}


@pytest.mark.parametrize('name', list(REGRESSIONS))
def test_regression_programs(name):
  check(REGRESSIONS[name])
