"""The parts of :mod:`einshard.placement` (private; import from ``einshard`` or ``einshard.placement``).

* :mod:`.meshes` — which mesh a placement uses (mesh=, the current mesh, the array's own; counts' anonymous mesh);
* :mod:`.resolve` — expression + shape + mesh -> Layout and NamedSharding (cached);
* :mod:`.traced` — placement under ``jax.jit`` / ``jax.grad``: reshard and sharding constraints;
* :mod:`.process_local` — ``process_local=True``: the global array from each process's slice;
* :mod:`.describe` — ``describe()``: the expression that reproduces an array's layout;
* :mod:`.agreement` — under several processes: every process places (and saves) the same shapes and layouts,
  checked through the distributed key-value store, with a bounded wait for the others.
"""
