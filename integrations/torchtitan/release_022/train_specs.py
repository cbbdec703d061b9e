"""torchtitan 0.2.2's TrainSpecs with UPipe: registered under "llama3" and "qwen3" when the
package is imported (``[experimental] custom_import``), identical to torchtitan's own except
for ``parallelize_fn`` and ``build_loss_fn`` (parallelize.py), with the Trainer's input
sharding routed through upipe's layout (cp_layout.py).
"""

from __future__ import annotations

from upipe_compile.integrations.torchtitan.release_022.parallelize import (
    build_loss_fn_upipe, parallelize_llama_upipe, parallelize_qwen3_upipe,
)

MODEL_NAMES = ("llama3", "qwen3")
_PARALLELIZE = {"llama3": parallelize_llama_upipe, "qwen3": parallelize_qwen3_upipe}


def get_train_spec(name: str = "llama3"):
    """torchtitan's TrainSpec for ``name`` ("llama3" or "qwen3") with the UPipe-aware
    parallelize and loss builders."""
    import dataclasses
    import importlib

    from upipe_compile.integrations.torchtitan.release_022.document_attention import varlen_model_args

    stock = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
    return dataclasses.replace(
        stock, parallelize_fn=_PARALLELIZE[name], build_loss_fn=build_loss_fn_upipe,
        model_args={flavor: varlen_model_args(args) for flavor, args in stock.model_args.items()},
    )


def register() -> tuple[str, ...]:
    """Register the specs under "llama3" and "qwen3" and route the Trainer's input sharding
    through upipe's layout for upipe jobs (idempotent); returns the names."""
    from torchtitan.protocols import train_spec as ts

    from upipe_compile.integrations.torchtitan.cp_layout import install_input_sharding

    install_input_sharding()  # ring layouts and varlen batches sharded upipe's way (cp_layout.py)

    for name in MODEL_NAMES:
        existing = ts._extra_train_specs.get(name)
        if existing is None:
            ts.register_train_spec(name, get_train_spec(name))
        elif existing.parallelize_fn is not _PARALLELIZE[name]:
            raise RuntimeError(f"another TrainSpec is already registered as {name!r}; cannot add upipe's")
    return MODEL_NAMES
