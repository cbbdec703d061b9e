"""torchtitan integration: UPipe context parallelism from the job's config alone.

torchtitan 0.3 (Python job configs): ``--module upipe_compile.integrations.torchtitan
--config llama3_8b_upipe_5m`` runs one of the configs of ``config_registry.py``, each a
:class:`~upipe_compile.integrations.torchtitan.release_03.trainer.UPipeTrainer` config (see
README.md next to this file). The rest of this docstring is the 0.2.2 TOML path.

torchtitan 0.2.2 (TOML):

Three keys turn it on (see llama3_8b_upipe.toml and README.md next to this file):

    [job]
    custom_config_module = "upipe_compile.integrations.torchtitan.config"   # the [upipe] section
    [experimental]
    custom_import = "upipe_compile.integrations.torchtitan"                 # this module
    [compile]
    enable = true
    backend = "upipe"

Importing this module calls :func:`register`, the one place it changes torchtitan: it
registers TrainSpecs under the names "llama3" and "qwen3" (torchtitan looks up user-registered
specs before its own), identical to torchtitan's specs except for ``parallelize_fn`` and
``build_loss_fn`` (see parallelize.py), and wraps the Trainer's and validator's
``prepare_context_parallel_input`` (cp_layout.py: torchtitan has no hook for a sharding
layout of one's own). All of these fall through to the stock functions unless
``[compile] backend = "upipe"``.
"""

from __future__ import annotations

from upipe_compile.integrations.torchtitan.config import UPipe, upipe_config
from upipe_compile.integrations.torchtitan.release import python_configs
from upipe_compile.integrations.torchtitan.release_022.parallelize import (
    build_loss_fn_upipe, check_job, compile_options, parallelize_llama_upipe, parallelize_qwen3_upipe, upipe_enabled,
)
from upipe_compile.integrations.torchtitan.release_022.train_specs import MODEL_NAMES, get_train_spec, register

__all__ = [
    "MODEL_NAMES", "UPipe", "build_loss_fn_upipe", "check_job", "compile_options", "get_train_spec",
    "parallelize_llama_upipe", "parallelize_qwen3_upipe", "register", "upipe_config", "upipe_enabled",
]

if not python_configs():  # 0.3 has no TrainSpecs: its configs carry upipe's parallelize (release_03/trainer.py)
    register()
