"""Models the demo trains: plain JAX functions over dict pytrees of parameters."""
