"""Memory measurement: the ops' eager twins, op memory on fake tensors, the fake process group."""
