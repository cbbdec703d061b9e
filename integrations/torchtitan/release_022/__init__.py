"""torchtitan 0.2.2, all of it in one place: a job is a TOML read into a JobConfig (with the
[upipe] section of config.py), the model a TrainSpec's ``model_args``.

- facts.py: the job facts the rules of job_rules.py ask, read from the JobConfig;
- train_specs.py: the "llama3" and "qwen3" TrainSpecs with UPipe (the package's ``__init__``
  registers them);
- parallelize.py: their ``parallelize_fn`` and ``build_loss_fn``;
- document_attention.py, rope_rows.py: the varlen flavors through UPipe, each rank's RoPE rows;
- estimate.py: the whole-step estimate's config loading, job build and training step.

The package's ``__init__`` imports train_specs.py (and through it parallelize.py); these
import 0.2.2's torchtitan only inside the functions that need it.
"""
