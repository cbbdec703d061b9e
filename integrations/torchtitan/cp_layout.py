"""The context-parallel layout of a torchtitan job under upipe, and the input sharding that
follows it.

torchtitan builds one "cp" mesh of P ranks. With ``[upipe] ring_degree = 1`` (the default)
upipe runs its all-to-all over all P of them and rank r holds tokens ``[r S/P, (r+1) S/P)``.
With ``ring_degree = R > 1`` the "cp" mesh is unflattened into ``("cp_ring", "cp_a2a")`` =
(R, P / R): each group of A = P / R consecutive CP ranks (put them in one node) is an
all-to-all group, and the R groups form the ring; the sequence is cut into 2R chunks, ring
rank r holds chunks r and 2R - 1 - r (causal balance), split contiguously over its A ranks
(:func:`upipe_compile.shard_sequence` over that mesh).

The job's parallelize records its layout mesh here (:func:`upipe_cp_mesh`), and
:func:`install_input_sharding` makes the Trainer's (and its validator's)
``prepare_context_parallel_input`` shard inputs and labels in it, with no ``positions``: each
rank's RoPE table holds its own rows (rope_rows.py). Packed documents (torchtitan's varlen
flavors) keep their full-sequence boundaries (document_attention.py). Jobs without upipe go to
torchtitan's function unchanged.
"""

from __future__ import annotations

import functools

from upipe_compile.attention.collectives import RING_MESH_DIMS
from upipe_compile.integrations.torchtitan.config import upipe_config

LAYOUT_ATTRIBUTE = "_upipe_layout"
"""Set on the job's "cp" mesh object (torchtitan's ParallelDims hands out the same one for the
job): the mesh upipe's layout follows -- the "cp" mesh itself, or its (cp_ring, cp_a2a)
unflattening. It lives and dies with the job's mesh: no process-wide table."""


def _recorded(cp_mesh):
    return getattr(cp_mesh, LAYOUT_ATTRIBUTE, None)


def upipe_cp_mesh(job_config, parallel_dims):
    """The mesh upipe compiles the blocks with and lays the sequence out over: torchtitan's
    "cp" mesh, or with a ring its (cp_ring, cp_a2a) unflattening (made once per job, on every
    rank: it creates process groups). Recorded for the input sharding."""
    cp_mesh = parallel_dims.get_mesh("cp")
    ring = upipe_config(job_config).ring_degree
    mesh = cp_mesh
    if ring > 1:
        known = _recorded(cp_mesh)
        if known is not None and known.ndim == 2 and known.size(0) == ring:
            mesh = known
        else:
            mesh = cp_mesh._unflatten(0, (ring, cp_mesh.size() // ring), RING_MESH_DIMS)
    setattr(cp_mesh, LAYOUT_ATTRIBUTE, mesh)
    return mesh


def forget_layout(parallel_dims) -> None:
    """A job that does not run upipe's context parallelism: torchtitan shards its inputs."""
    if parallel_dims.cp_enabled:
        cp_mesh = parallel_dims.get_mesh("cp")
        if hasattr(cp_mesh, LAYOUT_ATTRIBUTE):
            delattr(cp_mesh, LAYOUT_ATTRIBUTE)


def layout_of(cp_mesh):
    """The upipe layout mesh recorded for ``cp_mesh``'s job; None for a job without upipe."""
    return _recorded(cp_mesh)


def shard_batch(inputs, labels, extra_kwargs, layout_mesh):
    """This rank's shard of ``inputs``/``labels`` [B, S] in upipe's layout, ``extra_kwargs``
    passed on (full-sequence varlen boundaries stay whole: every rank's stages see the whole
    sequence) with no positions."""
    from upipe_compile.sharding import shard_sequence

    inputs, labels = (shard_sequence(t, layout_mesh, dim=1) for t in (inputs, labels))
    return inputs, labels, {key: value for key, value in extra_kwargs.items() if key != "positions"}


def _upipe_layout(original):
    @functools.wraps(original)
    def prepare_context_parallel_input(inputs, labels, extra_kwargs, cp_mesh, device, load_balancer_type="headtail"):
        layout = layout_of(cp_mesh)
        if layout is None:
            return original(inputs, labels, extra_kwargs, cp_mesh, device, load_balancer_type)
        return shard_batch(inputs, labels, extra_kwargs, layout)

    prepare_context_parallel_input.upipe_layout = True
    return prepare_context_parallel_input


def install_input_sharding() -> None:
    """Route the Trainer's and validator's ``prepare_context_parallel_input`` through
    :func:`shard_batch` for upipe jobs (idempotent)."""
    import torchtitan.components.validate as validate
    import torchtitan.train as train

    for module in (train, validate):
        if not getattr(module.prepare_context_parallel_input, "upipe_layout", False):
            module.prepare_context_parallel_input = _upipe_layout(module.prepare_context_parallel_input)
