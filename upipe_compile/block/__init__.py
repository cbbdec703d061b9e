"""The fused attention block: the region the pass cuts out, its head-chunk loop and its ops."""
