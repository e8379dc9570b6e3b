"""A mutation run: put one plausible bug into brainnx at a time and see whether the tests notice.

Run from the repository root (not part of ``pytest``'s default run)::

    python tests/mutation/run.py                 # every mutant against its targeted tests
    python tests/mutation/run.py --only place    # mutants whose name contains 'place'
    python tests/mutation/run.py --full          # survivors then against the whole suite

Each mutant is a small textual patch to one function (``old`` must occur exactly once in
``file``) and the tests that should catch it. The run copies the repository to a scratch
directory per mutant, applies the patch there, runs the targeted tests, and prints the kill
rate and the survivors. A survivor is a test to write, or an equivalent mutant to explain.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str
  old: str
  new: str
  tests: tuple[str, ...]


# the conformance case for values written between calls, on every transform
WRITES_SEEN = ('-k', 'value_written', 'tests/test_conformance.py')

MUTANTS = [
  # the eight survivors of the first measured run, each now with a test
  Mutant('vmap places the batch axis the wrong way', 'brainnx/_transforms/vmap_outputs.py',
         'return jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), value)',
         'return jax.tree.map(lambda x: jnp.moveaxis(x, axis, 0), value)',
         ('tests/test_vmap.py',)),
  Mutant('vmap broadcasts a Module passed by keyword', 'brainnx/_transforms/vmap_axes.py',
         "return False, 0, f'keyword argument {root.name!r}'",
         "return False, None, f'keyword argument {root.name!r}'",
         ('tests/test_vmap.py',)),
  Mutant('eval_shape returns zero arrays', 'brainnx/_engine/stateful_function.py',
         'return trace.out_shapes(disc)',
         'return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), trace.out_shapes(disc))',
         ('tests/test_eval_shape.py',)),
  Mutant('grad_states=module differentiates every Variable', 'brainnx/_transforms/grad_targets.py',
         'for path, var in nnx.to_flat_state(nnx.state(node, to_filter(selects)))',
         'for path, var in nnx.to_flat_state(nnx.state(node))',
         ('tests/test_grad.py',)),
  Mutant('hessian gives the cross block with the first', 'brainnx/_transforms/grad.py',
         'blocks = tuple([h[g][k][g][k] for k in range(len(args[g]))] for g in range(len(argnums)))',
         'blocks = tuple([h[g][k][g][0] for k in range(len(args[g]))] for g in range(len(argnums)))',
         ('tests/test_autodiff.py',)),
  Mutant('a full trace cache evicts the newest entry', 'brainnx/_engine/caches.py',
         '      while len(self._data) > self.maxsize:\n        gone.append(self._data.popitem(last=False)[1])',
         '      while len(self._data) > self.maxsize:\n        gone.append(self._data.popitem(last=True)[1])',
         ('tests/test_tracing.py',)),
  # a call's object graph
  Mutant('attachments are not attached', 'brainnx/_engine/structure.py',
         '        _compat.restore_entries(container, {key: value}, MISSING)',
         '        pass',
         ('tests/test_object_graph.py', 'tests/test_conformance.py')),
  Mutant('outputs merged without the shared references', 'brainnx/_engine/state.py',
         'return out_spec.rebuild(out_leaves, disc, index_ref), attached',
         'return out_spec.rebuild(out_leaves, disc, None), attached',
         ('tests/test_object_graph.py',)),
  Mutant('known objects are not references when splitting', 'brainnx/_compat/flax_graph.py',
         '    ref_map[object() if obj is None else obj] = k',
         '    ref_map[object()] = k',
         ('tests/test_object_graph.py', 'tests/test_conformance.py')),
  Mutant('a dict-valued write in place is not a write', 'brainnx/_engine/state.py',
         '      written.add(i)\n  return StepResult',
         '      pass\n  return StepResult',
         ('tests/test_object_graph.py',)),
  Mutant('the trace keeps what it attached', 'brainnx/_engine/state.py',
         '    finally:\n      disc.restore(contents)',
         '    finally:\n      pass',
         ('tests/test_object_graph.py',)),
  Mutant('a lazily bound global is not rebound', 'brainnx/_engine/structure.py',
         '        disc.rebind(k, value)',
         '        pass',
         ('tests/test_object_graph.py',)),
  Mutant('metadata is not guarded', 'brainnx/_engine/guard.py',
         '        if any(metadata_of(v) != saved for v, saved in metadata):',
         '        if False:',
         ('tests/test_object_graph.py',)),
  Mutant('x64 is not in the trace key', 'brainnx/_engine/tracing.py',
         '  return (config.jax_enable_x64, config.jax_default_matmul_precision,',
         '  return (None, config.jax_default_matmul_precision,',
         ('tests/test_object_graph.py',)),
  Mutant('wrappers do not share their caches', 'brainnx/_engine/jitted.py',
         '    traces, self._compiled = (_shared_caches(fun, options) if traced is None else None) or (None, LRUCache(64))',
         '    traces, self._compiled = None, LRUCache(64)',
         ('tests/test_object_graph.py',)),
  Mutant('a followed replacement leaves the old Variable in the discovery', 'brainnx/_engine/discovery.py',
         '      self.variables[i] = new\n',
         '',
         ('tests/test_object_graph.py',)),
  Mutant('opaque outputs holding tracers are returned', 'brainnx/_engine/outputs.py',
         '      if _opaque(x) and (holds_graph_node(x) or _holds_traced(x)):',
         '      if False:',
         ('tests/test_object_graph.py',)),
  Mutant('registered dataclass outputs are opaque', 'brainnx/_engine/outputs.py',
         '  return len(children) == 1 and children[0] is x',
         '  return True',
         ('tests/test_object_graph.py',)),
  Mutant('branches may not restructure a write', 'brainnx/_transforms/control.py',
         '    b.restructured = restructured',
         '    b.restructured = frozenset()',
         ('tests/test_object_graph.py',)),
  # write-back, rollback and the trace
  Mutant('the first discovered Variable is never written', 'brainnx/_engine/state.py',
         'written = {i for i, (a, b) in enumerate(zip(now, state_values)) if a is not b}',
         'written = {i for i, (a, b) in enumerate(zip(now, state_values)) if a is not b and i > 0}',
         ('tests/test_jit.py',)),
  Mutant('the warm jit path drops its writes', 'brainnx/_engine/plan.py',
         '    set_values(list(map(plan.variables.__getitem__, written)), values)',
         '    pass',
         ('tests/test_jit.py',)),
  Mutant('a tracer is written out of a raw JAX transform', 'brainnx/_engine/state.py',
         '    if _holds_tracer(x) and not _compat.can_update(variables[i]):',
         '    if False:',
         ('tests/test_safety.py', 'tests/test_conformance.py')),
  Mutant('a leaked tracer is accepted', 'brainnx/_engine/call.py',
         '    if top and any(isinstance(x, _compat.Tracer) for x in jax.tree.leaves(value)):\n      raise RuntimeError(',
         '    if False:\n      raise RuntimeError(',
         ('tests/test_conformance.py',)),
  Mutant('reads are not recorded', 'brainnx/_engine/tracing.py',
         '      read.add(i)',
         '      pass',
         ('tests/test_tracing.py',)),
  # cache keys and the guard
  Mutant('the trace key misses the dtype', 'brainnx/_engine/state.py',
         'return treedef, tuple((a.shape, a.dtype, a.weak_type, a.sharding, manual(a)) for a in leaves)',
         'return treedef, tuple((a.shape, a.weak_type, a.sharding, manual(a)) for a in leaves)',
         ('tests/test_jit.py', 'tests/test_tracing.py')),
  Mutant('closure cells are not guarded', 'brainnx/_engine/guard.py',
         '      if cells:',
         '      if False:',
         ('tests/test_guard.py', 'tests/test_jit.py')),
  Mutant('graph entries are not compared by identity', 'brainnx/_engine/guard.py',
         '    return all(map(is_, graph_at(now), saved[1]))',
         '    return True',
         ('tests/test_guard.py', 'tests/test_jit.py')),
  Mutant('a rebound global counter retraces', 'brainnx/_engine/stateful_function.py',
         '      if disc.refresh_captured():',
         '      if False:',
         ('tests/test_conformance.py',)),
  Mutant('a trace-changed plain counter retraces', 'brainnx/_engine/discovery.py',
         '    if statics_changed and self.guard.take_plain_statics():',
         '    if False:',
         ('tests/test_object_graph.py',)),
  Mutant('shared aliases are not recorded', 'brainnx/_engine/discovery.py',
         '        self.aliases.append((i, path, root))',
         '        pass',
         ('tests/test_discovery.py', 'tests/test_vmap.py')),
  Mutant('slots objects are not walked', 'brainnx/_engine/nodes.py',
         "  return '__dict__' in dir(cls) or bool(slot_names(cls))",
         "  return '__dict__' in dir(cls)",
         ('tests/test_object_graph.py',)),
  Mutant('a one-off eager call compiles', 'brainnx/_engine/jitted.py',
         '    once = self._options.compile_on_reuse and not plan.ran and not self._options.sharded',
         '    once = False',
         ('tests/test_conformance.py',)),
  Mutant('an Auto-axis sharding splits the trace key', 'brainnx/_engine/state.py',
         '      t != jax.sharding.AxisType.Auto for t in sharding.mesh.axis_types):',
         '      True for t in sharding.mesh.axis_types):',
         ('tests/test_pmap_map.py',)),
  # filters, RNG and mapping
  Mutant('the last matching filter wins', 'brainnx/_engine/filters.py',
         '    for axis, predicate, _ in self.entries:',
         '    for axis, predicate, _ in reversed(self.entries):',
         ('tests/test_vmap.py', 'tests/test_stacked_axes.py')),
  Mutant('a stream is not advanced', 'brainnx/_engine/rng.py',
         '  return count + jnp.ones_like(count)',
         '  return count',
         ('tests/test_vmap.py',)),
  Mutant('every element draws the same key', 'brainnx/_engine/rng.py',
         '    return jax.random.split(base, size)',
         '    return jnp.stack([base] * size)',
         ('tests/test_vmap.py',)),
  Mutant('mapped streams keep their count', 'brainnx/_transforms/vmap.py',
         '    streams = [c for _, c in layout.split_streams]',
         '    streams = []',
         ('tests/test_vmap.py',)),
  Mutant('a returned input Variable is the first one', 'brainnx/_engine/outputs.py',
         '        out.append(disc.variables[slot.index])',
         '        out.append(disc.variables[0])',
         ('tests/test_conformance.py',)),
  # loops, control flow, progress, shardings, donation
  Mutant('a carried value keeps its promoted dtype', 'brainnx/_engine/loop_body.py',
         '      return jax.lax.convert_element_type(n, jnp.result_type(o))',
         '      return n',
         ('tests/test_loops.py',)),
  Mutant('the scan step counter does not count', 'brainnx/_transforms/scan.py',
         '      counter = (run_id, i + 1)',
         '      counter = (run_id, i)',
         ('tests/test_progress.py',)),
  Mutant('the progress bar misses the last update', 'brainnx/_transforms/progress.py',
         '    due = jnp.logical_or((i + 1) % self.freq == 0, i + 1 >= self.n)',
         '    due = (i + 1) % self.freq == 0',
         ('tests/test_progress.py',)),
  Mutant('cond takes only positive predicates as true', 'brainnx/_transforms/control.py',
         '  truth = pred if pred.dtype == jnp.bool_ else given != 0',
         '  truth = pred if pred.dtype == jnp.bool_ else given > 0',
         ('tests/test_control.py',)),
  Mutant('ifelse takes the last true condition', 'brainnx/_transforms/control.py',
         '  index = jnp.where(jnp.any(flags), jnp.argmax(flags), len(branches) - 1).astype(jnp.int32)',
         '  index = jnp.where(jnp.any(flags), len(flags) - 1 - jnp.argmax(flags[::-1]), len(branches) - 1).astype(jnp.int32)',
         ('tests/test_control.py',)),
  Mutant('an indivisible sharding is accepted', 'brainnx/_engine/sharding.py',
         '    if shape[dim] % size:',
         '    if False:',
         ('tests/test_sharding.py',)),
  Mutant('donate_states donates every written Variable', 'brainnx/_engine/jitted.py',
         '    predicate = (lambda path, var: True) if spec is True else to_filter(spec)',
         '    predicate = lambda path, var: True',
         ('tests/test_donation.py',)),
  # issue 35's rules
  Mutant('bounded_while_loop saves every slot', 'brainnx/_transforms/bounded_while.py',
         '  if slots > base:  # the innermost level', '  if False:  # the innermost level',
         ('tests/test_loops.py::test_bounded_while_loop_keeps_fewer_values_for_the_backward_pass_than_a_scan',)),
  Mutant('bounded_while_loop ignores max_steps', 'brainnx/_transforms/bounded_while.py',
         '    return jnp.logical_and(i < max_steps, cond_w(state))', '    return cond_w(state)',
         ('tests/test_loops.py',)),
  Mutant("fori_loop's index is strongly typed", 'brainnx/_transforms/while_loops.py',
         '    return body_fun(_compat.weakly_typed(i), carry), None', '    return body_fun(i, carry), None',
         ('tests/test_loops.py',)),
  Mutant('an empty batch runs one element', 'brainnx/_transforms/vmap.py',
         "  pad = layout.size == 0 and cfg.mapper is Mapper.PMAP", "  pad = layout.size == 0",
         ('tests/test_vmap.py',)),
  Mutant('stacked sharding metadata keeps one layer\'s rank', 'brainnx/_engine/filters.py',
         '  if isinstance(sharding, (tuple, list)) and len(sharding) == ndim - 1:',
         '  if False:',
         ('tests/test_sharding.py',)),
  Mutant('DiffState filters ignored', 'brainnx/_transforms/grad_targets.py',
         "        self.node_args[k] = self._node(call_args[k], (filters or {}).get(k, nnx.Param), k)",
         "        self.node_args[k] = self._node(call_args[k], nnx.Param, k)",
         ('tests/test_grad.py',)),
  # issue 36: the four panels, and a class called as the function
  Mutant('a class called as the function is not explored', 'brainnx/_engine/roots.py',
         '  if isinstance(obj, type):\n    return user_constructor(obj) is not None',
         '  if isinstance(obj, type):\n    return False',
         ('tests/test_discovery.py',)),
  Mutant('the adversarial term is left out of the demo', 'brainnx/demo.py',
         'return loss + jnp.where(adversarial, network_loss(model, x + epsilon * jnp.sign(dx), y, nll), 0.0)',
         'return loss + 0.0 * jnp.where(adversarial, network_loss(model, x + epsilon * jnp.sign(dx), y, nll), 0.0)',
         ('tests/test_demo.py',)),
  Mutant('panel (i) reads its spread as a mixture', 'brainnx/examples/ensemble.py',
         '  if panel.nll:\n    return mixture(rows)',
         '  if True:\n    return mixture(rows)',
         ('tests/test_demo.py',)),
  # issue 37: a warm call after edits elsewhere
  Mutant('edits of the guarded Pytrees are taken for edits elsewhere', 'brainnx/_engine/guard.py',
         'return not nodes.isdisjoint(owners), not variables.isdisjoint(owners)',
         'return False, not variables.isdisjoint(owners)',
         ('tests/test_guard.py',)),
  Mutant('a log that no longer reaches back is trusted', 'brainnx/_engine/guard.py',
         '      if new >= maxlen:\n        return everything  # the log no longer reaches back to the last check',
         '      if new >= maxlen:\n        return False, False  # the log no longer reaches back to the last check',
         ('tests/test_guard.py',)),
  # issue 37: the values a warm call kept
  Mutant('flax setattr writes keep the kept values', 'brainnx/_compat/flax_hooks.py',
         "      if name == '_raw_value':\n        writes.n += 1\n        if kept:\n          _patch_kept(self)\n",
         "      if name == '_raw_value':\n        pass\n",
         WRITES_SEEN),
  Mutant('a flax write from another thread does not wait for a trace', 'brainnx/_compat/flax_hooks.py',
         '  def hooked_set_value(self, value, **kwargs):\n    acquire()\n    try:\n      return set_value(self, value, **kwargs)\n    finally:\n      release()',
         '  def hooked_set_value(self, value, **kwargs):\n    return set_value(self, value, **kwargs)',
         ('tests/test_safety.py',)),
  Mutant('nnx.jit_partial write-backs keep the kept values', 'brainnx/_compat/flax_hooks.py',
         "    install(_compilation, '_apply_raw_updates', marked(counting_raw_updates, apply_raw_updates), apply_raw_updates)\n", '',
         WRITES_SEEN),
  Mutant('a write of many values keeps the kept lists', 'brainnx/_compat/flax_hooks.py',
         '  if variable is None:\n    KEPT_VALUES.clear()\n    return\n',
         '  if variable is None:\n    return\n',
         WRITES_SEEN),
  Mutant("brainnx's own batch writes are not counted", 'brainnx/_compat/flax_hooks.py',
         '    for variable, value in zip(variables, values):\n      store(variable, \'_raw_value\', value)\n  finally:\n    values_written()',
         '    for variable, value in zip(variables, values):\n      store(variable, \'_raw_value\', value)\n  finally:\n    pass',
         WRITES_SEEN),
  Mutant('a set_value puts its value at the wrong place of a kept list', 'brainnx/_compat/flax_hooks.py',
         '    if i is not None:\n      values[i] = new\n', '    if i is not None:\n      values[0] = new\n',
         WRITES_SEEN),
  Mutant('a set_value patches no kept list', 'brainnx/_compat/flax_hooks.py',
         '    if i is not None:\n      values[i] = new\n', '    if i is not None:\n      pass\n',
         WRITES_SEEN),
  Mutant('a write-back leaves the kept values from before it', 'brainnx/_engine/plan.py',
         '        kept[i] = x\n', '        pass\n',
         ('tests/test_jit.py',)),
  # issue 34's template
  Mutant('the eager cache ignores the config', 'brainnx/_engine/eager.py',
         '  key = (impl, tuple(o is None for o in roots), hashable(config), options.statics)',
         '  key = (impl, tuple(o is None for o in roots), options.statics)',
         ('tests/test_loops.py', 'tests/test_control.py', 'tests/test_conformance.py')),
  Mutant('a vmap object makes a new program every call', 'brainnx/_transforms/vmap.py',
         '    if self._program is None:', '    if True:',
         ('tests/test_vmap.py',)),
  Mutant('loop errors say scan whatever the loop', 'brainnx/_transforms/layer_checks.py',
         "    f'{name}: {disc.describe(stacks[0])}{also}", "    f'scan: {disc.describe(stacks[0])}{also}",
         ('tests/test_stacked_axes.py',)),
  # issue 45: defects that programs written outside the suite found
  Mutant("a returned node's pytree-valued Variable gets one leaf", 'brainnx/_engine/outputs.py',
         'values = [jax.tree.unflatten(d, [next(it) for _ in range(d.num_leaves)]) for d in slot.value_defs]',
         'values = [next(it) for d in slot.value_defs]',
         ('-k', 'pytree_comes_back or popped', 'tests/test_conformance.py', 'tests/test_object_graph.py')),
  Mutant('a container empty when discovered is not watched', 'brainnx/_engine/guard.py',
         '      if still_stateless is not None and not still_stateless():',
         '      if False:',
         ('-k', 'empty_at_the_first or first_use', 'tests/test_conformance.py', 'tests/test_object_graph.py')),
  Mutant('following a replaced Variable keeps the kept lists', 'brainnx/_engine/discovery.py',
         '    _compat.values_written()  # kept value lists name the old Variables: forget them all\n', '',
         ('-k', 'replaced_on_every', 'tests/test_conformance.py')),
  Mutant('methods of classes met as data are not searched', 'brainnx/_engine/discovery.py',
         '  finder.explore_classes(walker.classes)\n', '',
         ('-k', 'global_variable_read', 'tests/test_conformance.py')),
  Mutant('a Variable reached twice gets two gradients', 'brainnx/_transforms/grad_targets.py',
         '      if isinstance(x, nnx.Variable) and id(x) in seen:', '      if False:',
         ('-k', 'reached_twice', 'tests/test_grad.py')),
  Mutant('eager jaxpr outputs are returned as they come', 'brainnx/_compat/jax_internals.py',
         '    return [x if isinstance(x, jax.Array) else jax.device_put(x) for x in outs]', '    return outs',
         ('-k', 'constant_written or passed_through', 'tests/test_grad.py', 'tests/test_control.py')),
  Mutant("a dropped plan's kept values stay", 'brainnx/_engine/plan.py',
         '    self.me = weakref.ref(self, lambda me, kept=self.kept_lists: kept.pop(me, None))',
         '    self.me = weakref.ref(self)',
         ('-k', 'dropped_models', 'tests/test_conformance.py')),
  Mutant('a warm call with a non-array value gives JAX\'s error', 'brainnx/_engine/plan.py',
         '      except TypeError:\n        explain_bad_values(plan)\n        raise',
         '      except TypeError:\n        raise',
         ('-k', 'non_array_between', 'tests/test_conformance.py')),
  Mutant('pmap retries only a ValueError', 'brainnx/_transforms/vmap.py',
         '    except _compat.DEVICE_MISMATCH_ERRORS as e:', '    except ValueError as e:',
         ('-k', 'committed_to_another', 'tests/test_pmap_map.py')),
  Mutant('cond under disable_jit traces every branch', 'brainnx/_transforms/control.py',
         '  if in_python():  # as jax.lax.cond', '  if False:  # as jax.lax.cond',
         ('-k', 'disable_jit_only', 'tests/test_control.py')),
  Mutant('a list of arrays replacing an attribute is no state', 'brainnx/_engine/discovery.py',
         '  return isinstance(x, ARRAY_TYPES) or holds_graph_node(x) or holds_array(x)',
         '  return isinstance(x, ARRAY_TYPES) or holds_graph_node(x)',
         ('-k', 'pytree_guide', 'tests/test_object_graph.py')),
  # issue 49: the survivors of an outside mutation run (57 plausible bugs, 22 lived), each now
  # with a test in its feature's file
  Mutant('a flax write patches only the first kept list', 'brainnx/_compat/flax_hooks.py',
         '    if i is not None:\n      values[i] = new\n',
         '    if i is not None:\n      values[i] = new\n      return\n',
         ('-k', 'every_warm_function', 'tests/test_guard.py')),
  Mutant("update_from_state's metadata is not an edit", 'brainnx/_compat/flax_hooks.py',
         "      elif name == '_var_metadata':  # update_from_state replacing the metadata\n        edited_metadata(self)\n",
         '',
         ('-k', 'metadata_replaced', 'tests/test_guard.py')),
  Mutant("copy_from's metadata is not an edit", 'brainnx/_compat/flax_hooks.py',
         '        values_written()\n        edited_metadata(self)\n',
         '        values_written()\n',
         ('-k', 'metadata_replaced', 'tests/test_guard.py')),
  Mutant('the guard compares a snapshot of a plain dict', 'brainnx/_engine/guard.py',
         'views = tuple(c.values() if isinstance(c, dict) else c for c in containers)',
         'views = tuple(list(c.values()) if isinstance(c, dict) else c for c in containers)',
         ('-k', 'gains_an_entry', 'tests/test_guard.py')),
  Mutant('a rebinding from a Module to a plain value is not rolled back', 'brainnx/_engine/discovery.py',
         '(holds_graph_node(now) or holds_graph_node(before))',
         'holds_graph_node(now)',
         ('-k', 'rebound', 'tests/test_safety.py')),
  Mutant('the warm path ignores keyword arguments', 'brainnx/_engine/plan.py',
         '      if kwargs or len(args) != n:',
         '      if len(args) != n:',
         ('-k', 'keyword_argument_added', 'tests/test_guard.py')),
  Mutant('the warm path sends a graph node to the array program', 'brainnx/_engine/plan.py',
         '      for x in args:\n        if type(x) not in fast_dyn and holds_graph_node(x):',
         '      for x in ():\n        if type(x) not in fast_dyn and holds_graph_node(x):',
         ('-k', 'passed_where_an_array', 'tests/test_guard.py')),
  Mutant('a plan over data attributes keeps its values list', 'brainnx/_engine/plan.py',
         'self.keeps_values = not any(type(v) is _compat.DataAttribute for v in disc.variables)',
         'self.keeps_values = True',
         ('-k', 'array_attribute_set', 'tests/test_guard.py')),
  Mutant('donate_states donates what the call only reads', 'brainnx/_engine/jitted.py',
         '    written = trace.written\n', '    written = trace.states\n',
         ('-k', 'only_what', 'tests/test_donation.py')),
  Mutant('the trace key misses the dtype promotion mode', 'brainnx/_engine/tracing.py',
         'config.jax_numpy_rank_promotion,\n          config.jax_numpy_dtype_promotion)',
         'config.jax_numpy_rank_promotion)',
         ('-k', 'standard_promotion', 'tests/test_tracing.py')),
  Mutant('a DiffState filter is dropped inside a container argument', 'brainnx/_transforms/grad_targets.py',
         'packs.append(self._node(x, selects, seen=seen))', 'packs.append(self._node(x, seen=seen))',
         ('-k', 'diffstate', 'tests/test_grad.py')),
  Mutant('a negative DiffState argnum loses its filter', 'brainnx/_transforms/grad.py',
         'by_arg = dict(zip(argnums, config.filters or ()))',
         'by_arg = dict(zip(config.argnums if isinstance(config.argnums, tuple) else (config.argnums,), config.filters or ()))',
         ('-k', 'diffstate', 'tests/test_grad.py')),
  Mutant("while_loop's cond reads the pre-loop values", 'brainnx/_transforms/while_loops.py',
         '    for i, x in zip(body.written, written):\n      values[i] = x\n    return cond.run_readonly',
         '    return cond.run_readonly',
         ('-k', 'reads_the_values_the_body', 'tests/test_loops.py')),
  Mutant('a written Variable goes out on axis 0 whatever its in-axis', 'brainnx/_transforms/vmap_axes.py',
         '  if in_axis is not None:\n    return in_axis\n', '  if in_axis is not None:\n    return 0\n',
         ('-k', 'axis_1_goes', 'tests/test_vmap.py')),
  Mutant('in_axes=-ndim is out of range', 'brainnx/_transforms/vmap_axes.py',
         'if -ndim <= axis < 0 else', 'if -ndim < axis < 0 else',
         ('-k', 'minus_ndim', 'tests/test_vmap.py')),
  Mutant('the partition name goes to position 0 whatever the stack axis', 'brainnx/_engine/filters.py',
         'names.insert(axis % ndim, partition_name)', 'names.insert(0, partition_name)',
         ('-k', 'partition_name_goes', 'tests/test_sharding.py')),
  Mutant('loops refuse a weakly typed write', 'brainnx/_engine/loop_body.py',
         'if jnp.result_type(n) != jnp.result_type(o) and not jax.typeof(n).weak_type:',
         'if jnp.result_type(n) != jnp.result_type(o):',
         ('-k', 'weakly_typed', 'tests/test_loops.py')),
  Mutant('globals of nested functions are not discovered', 'brainnx/_engine/roots.py',
         '  for const in code.co_consts:\n    if isinstance(const, types.CodeType):',
         '  for const in ():\n    if isinstance(const, types.CodeType):',
         ('-k', 'nested_function', 'tests/test_discovery.py')),
]


def _scratch_copy(dest: Path) -> None:
  ignore = shutil.ignore_patterns('.git', '__pycache__', '*.egg-info', '_build', '.ipynb_checkpoints')
  for name in ('brainnx', 'tests', 'notebooks', 'benchmarks', 'docs'):
    if (ROOT / name).exists():
      shutil.copytree(ROOT / name, dest / name, ignore=ignore)
  for name in ('pyproject.toml', 'README.md', 'CHANGELOG.md', 'LICENSE'):
    if (ROOT / name).exists():
      shutil.copy(ROOT / name, dest / name)


def run_mutant(mutant: Mutant, tests: tuple[str, ...], timeout: int) -> bool:
  """Whether the tests kill ``mutant`` (fail with it in place)."""
  with tempfile.TemporaryDirectory(prefix='brainnx-mutant-') as scratch:
    dest = Path(scratch)
    _scratch_copy(dest)
    path = dest / mutant.file
    text = path.read_text()
    if text.count(mutant.old) != 1:
      raise SystemExit(f'{mutant.name}: the patch does not apply once to {mutant.file} (found {text.count(mutant.old)})')
    path.write_text(text.replace(mutant.old, mutant.new))
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE='1')
    cmd = [sys.executable, '-m', 'pytest', '-q', '-x', '-n', '0', '-p', 'no:cacheprovider', '--no-header', *tests]
    try:
      done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return True  # a mutant that hangs the tests is noticed
    return done.returncode != 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='run the mutants whose name contains this')
  parser.add_argument('--start', type=int, default=0, help='skip the first START mutants')
  parser.add_argument('--full', action='store_true', help='run survivors against the whole suite')
  parser.add_argument('--timeout', type=int, default=900)
  args = parser.parse_args(argv)
  chosen = [m for m in MUTANTS[args.start:] if args.only in m.name]
  survivors = []
  for m in chosen:
    t0 = time.perf_counter()
    killed = run_mutant(m, m.tests, args.timeout)
    if not killed and args.full:
      killed = run_mutant(m, ('tests', 'notebooks'), args.timeout)
    print(f"{'killed ' if killed else 'SURVIVED'} {time.perf_counter() - t0:6.1f}s  {m.name}", flush=True)
    if not killed:
      survivors.append(m.name)
  print(f'\n{len(chosen) - len(survivors)} of {len(chosen)} mutants killed')
  for name in survivors:
    print(f'  survived: {name}')
  return 1 if survivors else 0


if __name__ == '__main__':
  sys.exit(main())
