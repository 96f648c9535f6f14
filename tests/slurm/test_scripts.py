"""The SLURM scripts submitted with `sbatch` to the real one-node SLURM (conftest.py), as a
user submits them: sbatch runs a copy of the script from slurmd's spool folder, so the
scripts must find the repository without their own path."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "examples" / "qwen2_5_32b"


def test_a_job_runs_through_the_real_scheduler(slurm, tmp_path):
    script = tmp_path / "smoke.sh"
    script.write_text('#!/bin/bash\necho "job $SLURM_JOB_ID"\nsrun hostname\n')
    job_id = slurm.sbatch(script, options=("--output=smoke-%j.out",), cwd=tmp_path)
    job = slurm.wait(job_id)
    output = slurm.output(job)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert job["StdOut"] == str(tmp_path / f"smoke-{job_id}.out")
    assert output.splitlines() == [f"job {job_id}", slurm.host]


def _dry_run_dirs(tmp_path: Path) -> dict[str, str]:
    dirs = {name: tmp_path / name.lower() for name in ("MODEL_DIR", "DATA_DIR", "OUTPUT_DIR")}
    for path in dirs.values():
        path.mkdir()
    return {name: str(path) for name, path in dirs.items()}


def _export(**env: str) -> str:
    return "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])


def test_train_sbatch_finds_the_repository_when_submitted_from_elsewhere(slurm, tmp_path):
    """Submitted from a folder that is not the repository's, with the header's 16 GPU nodes
    overridden on the command line and an override for the trainer after the script."""
    dirs = _dry_run_dirs(tmp_path)
    # This node has no GPU (--gpus-per-node=0); the dry run of the GPU recipe says it has 8,
    # and one node's 8 take tp 8 x pp 1 (the script reads the layout and refuses one that
    # does not load).
    options = ("--nodes=1", "--gpus-per-node=0", _export(DRY_RUN="1", GPUS_PER_NODE="8", **dirs))
    args = ("rollout.gpu_memory_utilization=0.4", "parallel.pp_size=1")
    job_id = slurm.sbatch(SCRIPTS / "train.sbatch", *args, options=options, cwd=tmp_path)
    job = slurm.wait(job_id)
    output = slurm.output(job)  # the header's --output=dapo-%j.out, in the submit folder
    assert job["StdOut"] == str(tmp_path / f"dapo-{job_id}.out")
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    lines = output.splitlines()
    plan = next(line for line in lines if "dapo-megatron plan" in line)
    assert f"-w {slurm.host} " in plan and f"plan {SCRIPTS / 'dapo.yaml'} " in plan
    assert f"/logs/{job_id}/attempt-0/plan.log" in plan
    assert any("ray start --head" in line for line in lines)
    train = next(line for line in lines if "dapo-megatron train examples/qwen2_5_32b/dapo.yaml" in line)
    assert f"model.hf_config={dirs['MODEL_DIR']}" in train and "rollout.gpu_memory_utilization=0.4" in train


def test_the_cpu_demo_command_trains_the_recipe_as_it_is(slurm, tmp_path):
    """The header's command for the demo on a node without GPUs, from the repository's
    root, as a dry run: the recipe's own model, data (JSONL) and layout (2 ranks, 1
    engine), no converted checkpoint (the trainer converts on load), Ray declaring CPUs
    for them; and, --time=10 being shorter than the header's 30-minute signal lead, a note
    that USR1 is ignored (it would come as every attempt starts)."""
    run = tmp_path / "run"
    settings = _export(DRY_RUN="1", RECIPE="examples/demo/demo.yaml", OUTPUT_DIR=str(run))
    options = ("--nodes=1", "--gpus-per-node=0", "--time=10", f"--output={tmp_path}/dapo-%j.out", settings)
    job = slurm.wait(slurm.sbatch(SCRIPTS / "train.sbatch", options=options, cwd=ROOT))
    output = slurm.output(job)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    lines = output.splitlines()
    train = next(line for line in lines if "dapo-megatron train examples/demo/demo.yaml" in line)
    overrides = train.split("demo.yaml ", 1)[1].split()
    assert overrides == [f"trainer.output_dir={run}", "parallel.num_nodes=1", f"ray.address={slurm.host}:6379"]
    head = next(line for line in lines if "ray start --head" in line)
    cpus = re.search(r"--num-cpus=(\d+) --num-gpus=0 ", head)
    assert cpus and int(cpus.group(1)) >= 2 + 1 + 1, head  # the demo's ranks + engine + driver, at least
    assert f"get('CPU', 0) >= {cpus.group(1)}" in next(x for x in lines if "cluster_resources" in x).replace("\\", "")
    for absent in ("num_devices_per_node", "num_engines", "engine_tp_size", "checkpoint.load_dir", "parquet", "model."):
        assert absent not in output, absent
    assert any("ignores USR1" in line and "(00:10:00)" in line for line in lines), output


def test_convert_sbatch_finds_the_demo_model_on_a_small_node(slurm, tmp_path):
    """The header's demo command (1 CPU, 4G instead of the 32B's 16 CPUs and 128G, which
    would keep it PENDING here): the recipe's own model folder, without MODEL_DIR."""
    settings = _export(DRY_RUN="1", RECIPE="examples/demo/demo.yaml", OUTPUT_DIR=str(tmp_path))
    options = ("--cpus-per-task=1", "--mem=4G", f"--output={tmp_path}/convert-%j.out", settings)
    job = slurm.wait(slurm.sbatch(SCRIPTS / "convert.sbatch", options=options, cwd=ROOT))
    output = slurm.output(job)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert f"hf-to-megatron --hf-dir {ROOT / 'runs' / 'demo' / 'base'} --out {tmp_path / 'demo_mcore'}" in output


def test_convert_sbatch_finds_the_repository_from_the_scripts_folder(slurm, tmp_path):
    """`sbatch convert.sbatch` in its own folder (a relative Command=); the header's 16 CPUs
    and 128G would keep it PENDING (Reason=PartitionConfig) on a small node: overridden."""
    dirs = _dry_run_dirs(tmp_path)
    options = ("--cpus-per-task=1", "--mem=1G", f"--output={tmp_path}/convert-%j.out", _export(DRY_RUN="1", **dirs))
    job_id = slurm.sbatch("convert.sbatch", "--verify", options=options, cwd=SCRIPTS)
    job = slurm.wait(job_id)
    output = slurm.output(job)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    expected = f"dapo-megatron convert hf-to-megatron --hf-dir {dirs['MODEL_DIR']} --out {dirs['OUTPUT_DIR']}/qwen2_5_32b_mcore --verify"
    assert expected in output


def test_a_copy_outside_the_repository_needs_repo_dir(slurm, tmp_path):
    """Without the repository anywhere in sight the job fails at once, saying what it tried
    and what to do; REPO_DIR then makes the same copy run."""
    dirs = _dry_run_dirs(tmp_path)
    copy = tmp_path / "convert.sbatch"
    shutil.copy(SCRIPTS / "convert.sbatch", copy)
    options = ("--cpus-per-task=1", "--mem=1G", "--output=convert-%j.out")
    failed = slurm.wait(slurm.sbatch(copy, options=(*options, _export(DRY_RUN="1", **dirs)), cwd=tmp_path))
    error = slurm.output(failed)
    assert (failed["JobState"], failed["ExitCode"]) == ("FAILED", "2:0"), error
    assert "convert.sbatch: cannot find the repository" in error and f"Command={copy}" in error
    assert "Set REPO_DIR" in error
    options = (*options, _export(DRY_RUN="1", REPO_DIR=str(ROOT), **dirs))
    fixed = slurm.wait(slurm.sbatch(copy, options=options, cwd=tmp_path))
    assert (fixed["JobState"], fixed["ExitCode"]) == ("COMPLETED", "0:0"), slurm.output(fixed)
    assert "dapo-megatron convert hf-to-megatron" in slurm.output(fixed)
