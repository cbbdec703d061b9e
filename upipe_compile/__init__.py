"""upipe-compile: a torch.compile backend that turns every scaled_dot_product_attention into
UPipe (untied Ulysses) context parallelism.

    model = torch.compile(model, backend="upipe", options={"cp_mesh": mesh, "heads_per_stage": U})
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from upipe_compile.api import upipe_attention
from upipe_compile.block.ops import upipe_attention_block
from upipe_compile.packed.document_sdpa import document_sdpa
from upipe_compile.packed.cu_seqlens import cu_seqlens_from_position_ids
from upipe_compile.errors import UnsupportedAttention
from upipe_compile.options import UPipeOptions
from upipe_compile.sharding import gather_sequence, global_positions, shard_sequence

__all__ = [
    "__version__",
    "UPipeOptions",
    "UnsupportedAttention",
    "apply_upipe_passes",
    "cu_seqlens_from_position_ids",
    "document_sdpa",
    "gather_sequence",
    "global_positions",
    "shard_sequence",
    "upipe_attention",
    "upipe_attention_block",
    "upipe_backend",
]


def __getattr__(name: str):
    # the backend, and the graph passes under it, load when a graph compiles: a training step's
    # imports (the ops, sharding, the stack) never load them
    if name in ("apply_upipe_passes", "upipe_backend"):
        from upipe_compile import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'upipe_compile' has no attribute {name!r}")
