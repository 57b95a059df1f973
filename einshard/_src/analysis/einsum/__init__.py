"""The einsum analysis, one way through: ``model`` (the records every step shares) < ``options`` (the
per-mesh-axis rule) < ``search`` (its parts and candidates, pruned and ranked) < ``read`` (what ``analyze``
reads from text and arguments) < ``plan`` (the :class:`EinsumPlan` and the strategy's name) < ``analyze``
(``analyze``, ``analyze_layouts``, ``plan_einsum``).  A module imports only the ones before it
(``tests/test_layers.py``); the public names are :mod:`einshard.analysis`'s.
"""
