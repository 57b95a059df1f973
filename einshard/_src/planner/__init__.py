"""The planner: ``einshard.plan(fn, *args)`` picks the layouts that make a step fastest within a memory budget.

It traces ``fn`` once and costs candidate assignments with the one cost
model einshard has, :func:`einshard.explain` (through
:class:`~einshard.analysis.program.TracedProgram`, which remembers per-op
costs), so a plan's numbers are exactly what ``explain`` prints for it.

The package: :mod:`.inputs` (budget, mesh, shapes), :mod:`.groups` (parameter
groups and candidate layouts), :mod:`.scoring` (an assignment's compute,
communication and memory), :mod:`.search` (exhaustive or guided descent),
:mod:`.explanation` (names and the ``why``), :mod:`.result` (``LayoutPlan``),
:mod:`.options` (``SearchOptions``: how the search walks), :mod:`.preset_match` (a ``presets=`` hand layout as
an assignment: searched from and compiled by ``verify=``), :mod:`.core` (``plan``).

How it works:

1. **Groups.**  Parameters (by default the first argument) are grouped by role:
   the path with list indices generalised (``['layers'][3]['w1']`` →
   ``['layers'][*]['w1']``); leaves of one group share one layout.  A leaf
   under a ``layers``/``blocks``/``stack`` key whose leading axis is shared by
   its siblings is a *stacked* layer axis (named ``l``).  The data arguments
   (the rest) form one group: the batch (leading) axis and, for rank ≥ 2, the
   sequence axis.
2. **Candidates** per group, einshard expressions over the mesh axes (of size
   > 1), pruned to those that divide: replicated; one axis split over one mesh
   axis (column/row tensor parallel, or FSDP when that mesh axis also splits
   the batch); one axis over two mesh axes; two axes over two mesh axes
   (FSDP × TP); a stacked layer axis over one mesh axis (the pipeline-stage
   layout, costed as ``jit`` runs it: the stack is gathered every step).  The
   batch: replicated, the batch axis over every non-empty set of mesh axes
   (in mesh order), and sequence parallel (sequence axis over a mesh axis the
   batch does not use).  Groups below 1 % of the parameter bytes stay
   replicated (their layout cannot matter for memory and barely for time).
3. **Score** of an assignment (:mod:`.scoring`): ``explain``'s step time =
   compute (the FLOPs each device executes, replicated work counted in full,
   over the profile's FLOP/s) + communication (α–β time of ``explain``'s
   collectives); objectives ``'training'``, ``'inference'`` (time),
   ``'memory'`` (bytes per device) or ``'communication'`` (bytes sent per
   device); ties broken by time, then memory, then communication.  Memory per
   device = ``explain``'s peak live bytes + optimizer state
   (``optimizer_bytes_per_param`` per parameter element held, default 8 for
   ``'training'``: Adam's two float32 moments, sharded like their parameter).
   An assignment over ``memory_budget`` ranks after every one that fits.
4. **Search** (:mod:`.search`): exhaustive when there are at most
   ``exhaustive_limit`` (256) assignments, else a guided coordinate descent
   that costs at most ``max_evaluations`` (160) of them (both
   :class:`SearchOptions` fields: ``plan(..., search=SearchOptions(...))``).
5. **Verify** (:mod:`.verify`, ``verify=k``; on by default when the program
   has an op without a layout rule): the k best and the best preset are
   compiled with XLA, shapes only, and ranked by the compiled collectives
   and memory.

Example:
    >>> import jax, jax.numpy as jnp, einshard
    >>> def loss(p, x):
    ...     return jnp.mean((jnp.tanh(x @ p['w1']) @ p['w2']) ** 2)
    >>> params = {'w1': jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
    ...           'w2': jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
    >>> batch = jax.ShapeDtypeStruct((65536, 1024), jnp.float32)
    >>> r = einshard.plan(jax.value_and_grad(loss), params, batch,
    ...                   mesh={'data': 8}, profile='h100')
    >>> r.rules[r"^\\['w1'\\]$"], r.data_rules[0]['^$']
    ('x y -> x y', 'b s -> b@data s')
"""

from __future__ import annotations

from .. import _checks
from .core import SMALL_GROUP_FRACTION, plan
from .groups import Candidate, Group, batch_candidates, param_candidates, param_groups
from .inputs import OBJECTIVES, mesh_axes_of, parse_bytes
from .options import EXHAUSTIVE_LIMIT, MAX_EVALUATIONS, PAIR_LIMIT, SearchOptions
from .pipelines import PipelineCost, PipelineSearch
from .result import Alternative, LayoutPlan
from .verify import DEFAULT_VERIFY, Verified


def _budget_rule(value: object, where: str, name: str, arguments: dict[str, object]) -> object:
    parse_bytes(value, name)  # type: ignore[arg-type]
    return value


_checks.RULES["budget"] = _budget_rule  # for the public wrappers that take a budget= (einshard.testing.assert_fits)

__all__ = [
    "plan",
    "SearchOptions",
    "LayoutPlan",
    "PipelineSearch",
    "PipelineCost",
    "Alternative",
    "Verified",
    "DEFAULT_VERIFY",
    "Candidate",
    "Group",
    "parse_bytes",
    "OBJECTIVES",
    "EXHAUSTIVE_LIMIT",
    "MAX_EVALUATIONS",
    "PAIR_LIMIT",
    "SMALL_GROUP_FRACTION",
]

# Older private names (tests and benchmarks of earlier versions used them).
_groups = param_groups
_param_candidates = param_candidates
_batch_candidates = batch_candidates
_mesh_axes = mesh_axes_of
