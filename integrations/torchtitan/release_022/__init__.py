"""torchtitan 0.2.2, all of it in one place: a job is a TOML read into a JobConfig (with the
[upipe] section of config.py), the model a TrainSpec's ``model_args``.

- facts.py: the job facts the rules of job_rules.py ask, read from the JobConfig;
- parallelize.py: the TrainSpecs' ``parallelize_fn`` and ``build_loss_fn`` (the package's
  ``__init__`` registers them);
- estimate.py: the whole-step estimate's config loading, job build and training step.

Nothing here is imported at the package's import: the modules import 0.2.2's torchtitan where
they need it.
"""
