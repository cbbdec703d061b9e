"""Checkpoints of the 0.3 config path through torchtitan's CheckpointManager (DCP): upipe
compiles the blocks in place, so a checkpoint holds the model's own names and moves between
jobs with and without upipe and between layouts. One seed checkpoint, written by a job without
upipe (``--checkpoint.create_seed_checkpoint``, one rank), starts the debug job at CP = 1
(no upipe), 2 and 4 with the same losses; the CP = 2 job's step-2 checkpoint resumes at CP = 2,
at CP = 4, over a 2 x 2 ring x all-to-all mesh, with other stages, and without upipe, each going on as the uninterrupted run.
fp32 throughout (tt03_checkpoint_jobs.run_job). Runs in the torchtitan 0.3 tier."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

import tt03_checkpoint_jobs as ckpt
from tests_support import relative_error

WITHOUT_UPIPE = ("--compile.no_enable",)
BOUND = 1e-5


@pytest.fixture(scope="module")
def seeded(rank_pools, tmp_path_factory):
    """The seed checkpoint (one rank, without upipe) and the CP = 2 upipe job started from it,
    4 steps, checkpointing every 2 (its step-2 checkpoint is what the resume tests start from)."""
    root = tmp_path_factory.mktemp("tt03_checkpoints")
    (seed,) = rank_pools(1).run(ckpt.run_job, 1, str(root / "seed"),
                                (*WITHOUT_UPIPE, "--checkpoint.create_seed_checkpoint"))
    from_seed = f"--checkpoint.initial_load_path={root / 'seed' / 'checkpoint' / 'step-0'}"
    cp2 = rank_pools(2).run(ckpt.run_job, 2, str(root / "cp2"), (from_seed, "--checkpoint.interval=2"))
    return SimpleNamespace(root=root, seed_keys=seed["state_keys"], from_seed=from_seed, cp2=cp2)


def resumed_from_cp2_step_2(seeded, name: str):
    """A job folder whose checkpoint folder holds the CP = 2 job's step-2 checkpoint, as a
    restarted job finds its own: torchtitan resumes from it (and ignores initial_load_path)."""
    folder = seeded.root / name
    shutil.copytree(seeded.root / "cp2" / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
    return str(folder)


def assert_ran_upipe_every_step(results):
    for rank, result in enumerate(results):
        for step, events in enumerate(result["counts"]):
            assert events.get("plain sdpa outside upipe", 0) == 0, (rank, step, events)
            assert events.get("upipe::attention_block", 0) > 0, (rank, step, events)


def assert_losses_equal(ours: dict, theirs: dict, steps):
    assert list(ours) == list(steps), (list(ours), list(steps))  # a resume goes on after the loaded step
    for step in steps:
        assert abs(ours[step] - theirs[step]) <= BOUND * abs(theirs[step]), (step, ours[step], theirs[step])


def test_one_seed_checkpoint_starts_every_layout_alike(rank_pools, seeded):
    """The seed loads into upipe jobs at CP = 2 and 4 (their state_dicts keyed by the model's
    own names) and into a one-rank job without upipe: all log the same 4 losses."""
    cp4 = rank_pools(4).run(ckpt.run_job, 4, str(seeded.root / "cp4"), (seeded.from_seed,))
    (cp1,) = rank_pools(1).run(ckpt.run_job, 1, str(seeded.root / "cp1"), (*WITHOUT_UPIPE, seeded.from_seed))
    assert not any("_orig_mod" in key for key in seeded.seed_keys)
    for result in (*seeded.cp2, *cp4, cp1):
        assert result["loaded"] and result["state_keys"] == seeded.seed_keys
        assert_losses_equal(result["losses"], cp1["losses"], range(1, ckpt.STEPS + 1))
    assert cp1["losses"][ckpt.STEPS] != cp1["losses"][1]
    assert_ran_upipe_every_step([*seeded.cp2, *cp4])


@pytest.mark.parametrize("world, overrides", [
    (2, ()),
    (4, ()),
    (2, ("--upipe.heads_per_stage=8",)),  # 2 stages of 8 heads instead of 8 of 2
    (4, ("--upipe.ring_degree=2",)),  # a 2 x 2 ring x all-to-all mesh
], ids=["cp2", "cp4", "cp2-8-heads-per-stage", "ring2x2"])
def test_a_resumed_job_goes_on_as_the_uninterrupted_one(rank_pools, seeded, world, overrides):
    """The CP = 2 job's step-2 checkpoint (model, optimizer, scheduler, data position, step)
    resumed in the same layout and in others: steps 3 and 4 log the uninterrupted run's losses
    and end with its parameters. A resume that started over or skipped data would not."""
    folder = resumed_from_cp2_step_2(seeded, f"resume-{world}-{'-'.join(overrides)}")
    resumed = rank_pools(world).run(ckpt.run_job, world, folder, (seeded.from_seed, *overrides))
    uninterrupted = seeded.cp2[0]
    for result in resumed:
        assert result["loaded"]
        assert_losses_equal(result["losses"], uninterrupted["losses"], (3, 4))
        assert result["params"].keys() == uninterrupted["params"].keys()
        for name, expected in uninterrupted["params"].items():
            err = relative_error(result["params"][name], expected)
            assert err <= BOUND, (name, err)
    assert_ran_upipe_every_step(resumed)


def test_a_upipe_checkpoint_resumes_without_upipe(rank_pools, seeded):
    """The CP = 2 upipe job's step-2 checkpoint in a one-rank job without upipe: its step 3
    logs the upipe job's step-3 loss."""
    folder = resumed_from_cp2_step_2(seeded, "resume-without-upipe")
    (plain,) = rank_pools(1).run(ckpt.run_job, 1, folder, WITHOUT_UPIPE, 3)
    assert plain["loaded"]
    assert_losses_equal(plain["losses"], seeded.cp2[0]["losses"], (3,))
