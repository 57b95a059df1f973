"""Applications built on the einshard library: the demo trainer, its presets and models, and the command line.

Nothing in ``einshard`` (the library) imports this package; it depends on the library's public API only where
it can, and never the reverse.  ``einshard --help`` starts no JAX: the command modules import the library when
a command runs.
"""
