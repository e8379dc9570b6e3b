"""The guard of a cached discovery: a cheap check that what a discovery saw is still what the
function sees (the objects behind its closure cells and globals, the entries of the containers
on the way, what counts edits to them).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from brainnx._engine.discovery import discover
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> guard = discover(lambda x: model(x), (jnp.ones(2),), {}).guard
  >>> before = guard.ok()
  >>> model.extra = nnx.Param(jnp.zeros(()))  # a new attribute: the function may now see more
  >>> before, guard.ok()
  (True, False)
"""

from __future__ import annotations

import itertools
import operator
from itertools import islice
from typing import Callable

from brainnx import _compat
from brainnx._engine.sentinels import MISSING

# What a guarded container entry is: compared by equality, by identity, or not at all (its
# value is state that calls write: a data-attribute array).
STATIC, GRAPH, DATA = 0, 1, 2

_chain = itertools.chain.from_iterable
_owner = operator.itemgetter(1)

# entries read past those counted since a guard's last check: an edit counted and not yet
# logged by another thread shifts the newest entries by one (see ``edited_here``)
_SLACK = 4


class Guard:
  """A cheap check that what a discovery saw is still what the function sees.

  It records the object behind every closure cell and global name the
  function (and the helpers it calls) loads, and the entries of every
  mutable container on the way (a Module's attribute dict, a plain
  object's, a dict, a list). ``ok()`` compares the names by identity and
  the entries in two C-level passes: the whole flattened list by equality
  (static attributes may be re-set to equal values), and the graph entries
  (Variables, Modules, containers holding them) by identity. Data-attribute
  arrays are state, like a Variable's value: not compared at all.

  The attribute dicts of flax Pytrees (Modules, ``nnx.List``, ``Rngs``, ...) and
  the Variables' metadata (which a function may read: ``v.get_metadata()``) are
  compared only when flax has changed some Pytree's attributes or Variable's
  metadata since the last passing check (``_compat.PYTREE_EDITS``); plain objects, dicts and lists, which
  nothing counts, are compared on every call. So a warm call over a deep model
  costs a few identity checks, not one comparison per attribute.
  """

  __slots__ = ('_cells', '_globals', '_all', '_uncounted', '_counted', '_metadata', '_owners', '_seen', '_stateless',
               'ok')

  def __init__(self, cells, globals_, containers, masks, counted, metadata=(), owners=None, stateless=()):
    self._cells = list(cells)  # [cell, object]
    self._globals = list(globals_)  # [namespace, name, object]
    self._metadata = list(metadata)  # [Variable, a copy of its metadata]
    # ids of the Pytrees and of the Variables whose edits matter here (None: any edit does)
    # (Pytrees, Variables, either or an unknown owner): the last answers 'any of ours?' in one pass
    self._owners = None if owners is None else (set(owners[0]), set(owners[1]), {*owners[0], *owners[1], None})
    self._all = _entry_check(containers, masks)
    self._uncounted = _entry_check(
      [c for c, n in zip(containers, counted) if not n], [m for m, n in zip(masks, counted) if not n]
    )
    self._counted = _entry_check([c for c, n in zip(containers, counted) if n], [m for m, n in zip(masks, counted) if n])
    self._seen = [-1]  # the edit count at the last passing full check; -1: none yet
    self._stateless = _stateless_check(stateless)
    self.ok = self._make_check()

  def _make_check(self):
    """``ok()`` as a closure over locals: this runs on every warm call (a few names: plain
    loops beat C-level ``map`` here, whose set-up costs more than the comparisons)."""
    cells, namespaces, metadata = self._cells, self._globals, self._metadata
    check_all, check_uncounted, seen, edits = self._all, self._uncounted, self._seen, _compat.PYTREE_EDITS
    still_stateless = self._stateless
    metadata_of, log = _compat.metadata_of, _compat.EDIT_LOG
    maxlen = log.maxlen
    nodes, variables, ours = self._owners if self._owners is not None else (None, None, None)
    everything = (True, True)

    def edited_here(since: int) -> tuple[bool, bool]:
      """Whether the edits after count ``since`` touched (the guarded Pytrees, the guarded
      Variables' metadata): both, when an edit's object is unknown or the log no longer reaches
      back that far. Edits of other objects touch neither. The newest entries are cut from the
      log in C and tested against this guard's owners in one C pass that builds nothing, so a
      burst of foreign edits (nnx.jit calls over another copy of the model: hundreds of node
      edits each) costs a pass, not a Python loop with a test per entry."""
      if nodes is None or since < 0:
        return everything
      new = edits.n - since
      if new >= maxlen:
        return everything  # the log no longer reaches back to the last check
      try:
        window = list(islice(reversed(log), new + _SLACK))
      except RuntimeError:  # another thread edited while we read
        return everything
      if len(window) < new or (len(window) > new and window[-1][0] > since):
        return everything  # the log no longer reaches back to the last check
      while window and window[-1][0] <= since:  # the slack read past the last check (newest first)
        window.pop()
      if ours.isdisjoint(map(_owner, window)):
        return False, False  # the common case: only other objects were edited
      owners = set(map(_owner, window))
      if None in owners:
        return everything
      return not nodes.isdisjoint(owners), not variables.isdisjoint(owners)

    def ok() -> bool:
      if cells:
        try:
          for cell, obj in cells:
            if cell.cell_contents is not obj:
              return False
        except ValueError:  # a cell was emptied
          return False
      for namespace, name, obj in namespaces:
        if namespace.get(name, MISSING) is not obj:
          return False
      if still_stateless is not None and not still_stateless():
        return False
      if edits.n == seen[0]:
        return check_uncounted is None or check_uncounted()
      mark = edits.n  # read before the check: an edit during it moves the count past mark
      touched_nodes, touched_variables = edited_here(seen[0])
      check = check_all if touched_nodes else check_uncounted
      if check is not None and not check():
        return False
      if touched_variables:
        try:
          if any(metadata_of(v) != saved for v, saved in metadata):
            return False
        except Exception:  # metadata holding arrays: no single truth value
          return False
      seen[0] = mark
      return True

    return ok

  def take_plain_statics(self) -> bool:
    """Expect the static attributes plain objects, dicts and lists hold now (a trace's own
    counter, ``self.steps += 1``), if no flax Pytree's attributes changed; whether it did."""
    if self._counted is not None and not self._counted():
      return False
    for check in (self._all, self._uncounted):
      if check is not None:
        check.resave()
    return True

  def follow(self, replaced: list) -> None:
    """Expect the containers as they are now, with ``(old, new)`` Variables swapped (see
    :meth:`Discovery.follow`)."""
    for check in (self._all, self._uncounted, self._counted):
      if check is not None:
        check.resave(graph=True)
    swap = {id(old): new for old, new in replaced}
    if self._owners is not None:
      _, variables, ours = self._owners
      for _, new in replaced:
        variables.add(id(new))
        ours.add(id(new))
    self._metadata[:] = [(swap[id(v)], dict(_compat.metadata_of(swap[id(v)]))) if id(v) in swap else (v, m)
                         for v, m in self._metadata]

  def rebind(self, source: tuple, obj) -> None:
    """Expect ``obj`` behind a captured name from now on: ``source`` is ``('cell', cell)`` or
    ``('global', namespace, name)`` (a plain value the traced call itself rebound)."""
    if source[0] == 'cell':
      self._cells[:] = [(c, obj if c is source[1] else o) for c, o in self._cells]
    else:
      self._globals[:] = [(ns, n, obj if (ns is source[1] and n == source[2]) else o) for ns, n, o in self._globals]


def _entry_check(containers, masks) -> Callable[[], bool] | None:
  """``check()``: whether ``containers`` hold the entries they hold now (see :class:`Guard`);
  ``None`` when there are none."""
  if not containers:
    return None
  views = tuple(c.values() if isinstance(c, dict) else c for c in containers)
  codes = list(_chain(masks))
  values = list(_chain(views))
  size = len(values)
  if DATA in codes:
    static_at = _picker([i for i, c in enumerate(codes) if c == STATIC])
  else:  # the common case: the whole list, compared in one C call
    static_at = _whole
  graph_at = _picker([i for i, c in enumerate(codes) if c == GRAPH])
  saved = [static_at(values), graph_at(values)]
  chain, is_ = _chain, operator.is_

  def check() -> bool:
    now = [*chain(views)]
    if len(now) != size:
      return False
    try:
      if static_at(now) != saved[0]:
        return False
    except Exception:  # an array compared with an array: no single truth value
      return False
    return all(map(is_, graph_at(now), saved[1]))

  def resave(graph: bool = False) -> None:
    """Expect the static entries the containers hold now (and, with ``graph``, their graph
    entries; else only if those are unchanged)."""
    now = [*chain(views)]
    if len(now) == size and (graph or all(map(is_, graph_at(now), saved[1]))):
      saved[:] = [static_at(now), graph_at(now)]

  check.resave = resave
  return check


def _stateless_check(containers) -> Callable[[], bool] | None:
  """``check()``: whether the containers that held no state when discovered (an empty
  ``nnx.data({})`` filled on first use, a plain list a Module is appended to) still hold none.
  Each is compared by identity with its saved entries; one that changed is searched for state,
  and its entries are saved anew if it holds none (a history list a loop appends floats to).
  ``containers`` holds ``(container, is_state)``: what counts as state in it."""
  if not containers:
    return None
  views = [(c.values() if isinstance(c, dict) else c, is_state) for c, is_state in containers]
  watched = [(view, list(view), is_state) for view, is_state in views]
  is_ = operator.is_

  def check() -> bool:
    for view, saved, holds in watched:
      if len(view) != len(saved) or not all(map(is_, view, saved)):
        if any(map(holds, view)):
          return False
        saved[:] = view
    return True

  return check


def _whole(values: list) -> list:
  return values


def _picker(positions: list):
  """``pick(values) -> tuple`` of the entries at ``positions`` (C-level for two or more)."""
  if not positions:
    return lambda values: ()
  if len(positions) == 1:
    (i,) = positions
    return lambda values: (values[i],)
  return operator.itemgetter(*positions)
