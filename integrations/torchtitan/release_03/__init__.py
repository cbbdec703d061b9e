"""torchtitan 0.3, all of it in one place: a job is a Python function returning a
``Trainer.Config`` (trainer.UPipeTrainer.Config, with the ``upipe`` section), the model a
ModelSpec's config.

- facts.py: the job facts the rules of job_rules.py ask, read from the config alone;
- parallelize.py: the ModelSpecs' ``parallelize_fn`` (UPipe CP, TP beside it, FSDP, AC);
- trainer.py: ``UPipeTrainer``, which takes over upipe jobs (input sharding, the loss);
- rope_positions.py: RoPE rows computed from each token's position (no table);
- estimate.py: the whole-step estimate's config loading, job build and training step.

The config functions ``--module upipe_compile.integrations.torchtitan --config NAME`` finds
are the integration's config_registry.py (torchtitan looks for that module name). Nothing
here is imported at the package's import: the modules import 0.3's torchtitan.
"""
