"""torchtitan 0.2.2 integration: UPipe context parallelism from the job TOML alone.

Three keys turn it on (see llama3_8b_upipe.toml and README.md next to this file):

    [job]
    custom_config_module = "upipe_compile.integrations.torchtitan.config"   # the [upipe] section
    [experimental]
    custom_import = "upipe_compile.integrations.torchtitan"                 # this module
    [compile]
    enable = true
    backend = "upipe"

Importing this module registers a TrainSpec under the name "llama3" (torchtitan looks up
user-registered specs before its own), identical to torchtitan's Llama3 spec except for
``parallelize_fn`` and ``build_loss_fn`` (see parallelize.py). Those fall through to the stock
functions unless ``[compile] backend = "upipe"``, so importing it changes nothing else.
"""

from __future__ import annotations

from upipe_compile.integrations.torchtitan.config import UPipe, upipe_config
from upipe_compile.integrations.torchtitan.parallelize import (
    build_loss_fn_upipe, check_job, compile_options, parallelize_llama_upipe, upipe_enabled,
)

MODEL_NAME = "llama3"

__all__ = [
    "MODEL_NAME", "UPipe", "build_loss_fn_upipe", "check_job", "compile_options", "get_train_spec",
    "parallelize_llama_upipe", "register", "upipe_config", "upipe_enabled",
]


def get_train_spec():
    """torchtitan's Llama3 TrainSpec with the UPipe-aware parallelize and loss builders."""
    import dataclasses

    from torchtitan.models import llama3

    from upipe_compile.integrations.torchtitan.documents import varlen_model_args

    spec = llama3.get_train_spec()
    return dataclasses.replace(
        spec, parallelize_fn=parallelize_llama_upipe, build_loss_fn=build_loss_fn_upipe,
        model_args={flavor: varlen_model_args(args) for flavor, args in spec.model_args.items()},
    )


def register() -> str:
    """Register the spec under "llama3" (idempotent); returns the name."""
    from torchtitan.protocols import train_spec as ts

    existing = ts._extra_train_specs.get(MODEL_NAME)
    if existing is None:
        ts.register_train_spec(MODEL_NAME, get_train_spec())
    elif existing.parallelize_fn is not parallelize_llama_upipe:
        raise RuntimeError(f"another TrainSpec is already registered as {MODEL_NAME!r}; cannot add upipe's")
    return MODEL_NAME


register()
