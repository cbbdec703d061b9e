"""The stage-loop attention op: its schedule, the loops, the kernels they call and the all-to-alls between them."""
