"""The Qwen2.5-32B recipe, `dapo-megatron plan`, and the SLURM scripts (shellcheck, dry runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.cli import main
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.plan import GIB, estimate_memory, make_plan
from tests.unit.test_config import QWEN_32B

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "qwen2_5_32b" / "dapo.yaml"


DEMO = ROOT / "examples" / "demo" / "demo.yaml"


@pytest.fixture(autouse=True)
def _elsewhere(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a config's paths are relative to its own folder, not the cwd


def test_recipe_has_the_papers_settings():
    cfg = load_config(RECIPE)
    assert (cfg.data.train_batch_size, cfg.rollout.n_samples_per_prompt, cfg.data.mini_batch_size) == (512, 16, 512)
    assert cfg.data.train_batch_size * cfg.rollout.n_samples_per_prompt // cfg.data.mini_batch_size == 16
    assert (cfg.trainer.lr, cfg.trainer.lr_warmup_steps) == (1e-6, 20)
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.2, 0.28)
    assert (cfg.rollout.max_response_length, cfg.algorithm.overlong_buffer_len) == (20480, 4096)
    assert cfg.algorithm.loss_agg_mode == "token-mean" and cfg.algorithm.dynamic_sampling
    assert (cfg.rollout.val_n_samples, cfg.rollout.val_temperature, cfg.rollout.val_top_p) == (32, 1.0, 0.7)
    assert cfg.model.transformer_impl == "transformer_engine" and cfg.model.params_dtype == "bfloat16"
    assert cfg.parallel.world_size == 128


def test_recipe_model_config_is_the_public_32b_one():
    import json

    shipped = json.loads((ROOT / "examples" / "qwen2_5_32b" / "config.json").read_text())
    # The public Qwen2.5-32B base model's config.json: the shape fields every test uses,
    # and the rest of the file.
    assert shipped == {
        **QWEN_32B,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_window_layers": 64,
        "sliding_window": 131072,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
    }


def test_plan_counts_parameters_exactly_and_matches_a_hand_computation():
    plan = make_plan(load_config(RECIPE))
    assert plan.num_parameters == 32_763_876_352
    assert plan.fits and plan.padded_vocab == 152_576 and plan.layer_split == [32, 32]
    # By hand, tp 8 x pp 2 x dp 8, the last stage (32 layers + final norm + output layer):
    per_layer_sharded = (5120 * 7168 + 7168) + 5120 * 5120 + 3 * 5120 * 27648  # qkv+bias, proj, mlp
    assert per_layer_sharded == 487_595_008
    last_stage = (32 * per_layer_sharded + 152_576 * 5120) // 8 + 32 * 2 * 5120 + 5120
    assert last_stage == 2_048_361_472
    mem = plan.memory
    assert mem.parameters == last_stage
    assert mem.weights == 2 * last_stage  # bf16
    assert mem.gradients == 4 * last_stage  # fp32 grad buffer
    assert mem.optimizer == 12 * last_stage // 8  # fp32 main + Adam m + v over dp = 8
    assert mem.activations == mem.activations_recompute == 32 * 24576 * (2 * 5120 // 8) * 2  # 2h/tp bytes, pp = 2
    assert mem.activations_no_recompute == 32 * 24576 * (5120 * 34 // 8) * 2  # sequence parallel: 34h/tp bytes
    chunk = 128 * 2**20 // (4 * 19_072)  # 1,759 tokens of the 19,072-row vocabulary shard
    assert mem.logprob == 2 * chunk * 19_072 * 4 + 24576 * 5120 * 2
    assert mem.sglang == int(0.6 * 80 * GIB)
    assert mem.sglang_weights == 32_763_876_352 * 2 // 4
    # The stage leader's q/k/v export buffers: 40 + 2 x 8 heads of 128 rows, weight and
    # bias, whole (gathered over tp), bf16, for the stage's 32 layers: 2.19 GiB.
    export = 32 * (40 + 2 * 8) * 128 * (5120 + 1) * 2
    assert mem.sync_export == export and 2.1 * GIB < export < 2.3 * GIB
    # The feeder (one per node: the stage leader) keeps two staging buffers, and the node's
    # 2 engines x 4 TP workers each open a CUDA context (0.5 GiB) on its GPU. The embedding
    # and the output layer (152,064 x 5,120 bf16: 1.56 GB each) are over the 512 MiB bucket,
    # so each is a bucket of its own, and both buffers grow to it.
    vocab_bucket = 152_064 * 5120 * 2
    assert mem.sync_staging == 2 * vocab_bucket and mem.engine_contexts == 2 * 4 * GIB // 2
    # During a sync (engines resident): while the output layer is gathered over tp 8, its
    # shards and its whole copy (152,576 padded rows) next to three 512 MiB buckets (being
    # filled, held back to flag the last one, just packed); SGLang's TP workers on the
    # engines' other GPUs each copy a whole bucket (up to 1.56 GB) to their own GPU.
    gathered = 152_576 * 5120 * 2
    assert mem.sync_in_flight == 2 * gathered + 3 * 512 * 2**20 and mem.sync_engine_copy == vocab_bucket
    assert mem.sync_transient == mem.sync_in_flight and 4.4 * GIB < mem.sync_in_flight < 4.5 * GIB
    sync = export + 2 * vocab_bucket + 4 * GIB
    assert (
        mem.train_phase
        == 2 * last_stage + 4 * last_stage + 12 * last_stage // 8 + mem.activations + mem.logprob + sync + 3 * GIB
    )
    assert mem.rollout_phase == (
        6 * last_stage + 12 * last_stage // 8 + int(0.6 * 80 * GIB) + sync + mem.sync_in_flight + 3 * GIB
    )
    assert 28 * GIB < mem.train_phase < 30 * GIB and 78 * GIB < mem.rollout_phase < 80 * GIB
    # While the engines hold 0.6 of the GPU, the actor keeps what it needs within the rest.
    assert mem.actor_allowance == 80 * GIB - int(0.6 * 80 * GIB) > mem.rollout_phase - mem.sglang
    # A checkpoint save gathers a rank's fp32 main weights and Adam moments in host memory.
    assert mem.checkpoint_host == 12 * last_stage


def test_what_a_sync_holds_while_it_runs_follows_what_is_copied():
    """At tp 1 every tensor the sync sends is a view of the live weights (nothing in flight
    at pp 1; at pp 2 the other stage's buckets arrive as copies: the largest, the
    1.56 GB output layer, and two more); a larger bucket size raises the three buckets'
    part; separate engines have no staging buffers or worker copies on the actor's GPUs,
    but rank 0 gathers and holds the same buckets."""
    vocab_bucket, bucket = 152_064 * 5120 * 2, 512 * 2**20
    tp1 = ["parallel.tp_size=1", "parallel.sequence_parallel=false", "rollout.num_engines=32"]
    flat = estimate_memory(load_config(RECIPE, [*tp1, "parallel.pp_size=1"]))
    assert flat.sync_in_flight == 0 and flat.sync_staging == 2 * vocab_bucket
    assert flat.sync_transient == flat.sync_engine_copy == vocab_bucket
    relayed = estimate_memory(load_config(RECIPE, tp1))
    assert relayed.sync_in_flight == vocab_bucket + 2 * bucket
    wide = estimate_memory(load_config(RECIPE, ["rollout.weight_sync_bucket_mb=2048"]))
    assert wide.sync_staging == 2 * 2048 * 2**20  # now the bucket is larger than any tensor
    assert wide.sync_in_flight == 2 * 152_576 * 5120 * 2 + 3 * 2048 * 2**20
    separate = estimate_memory(load_config(RECIPE, ["rollout.colocate=false", "rollout.num_engines=16"]))
    assert separate.sync_staging == separate.sync_engine_copy == 0
    assert separate.sync_in_flight == estimate_memory(load_config(RECIPE)).sync_in_flight


@pytest.mark.parametrize(
    ("overrides", "reason", "suggestion"),
    [
        (
            ["rollout.gpu_memory_utilization=0.9"],
            "rollout phase needs 102.8 GiB per GPU > parallel.gpu_memory_gb=80",
            "rollout.gpu_memory_utilization=0.6",
        ),
        (
            ["parallel.num_nodes=4", "rollout.num_engines=32", "rollout.gpu_memory_utilization=0.5"],
            "colocated engines must cover the actor's GPUs",
            "rollout.num_engines=8",
        ),
        (
            [
                "parallel.tp_size=1",
                "parallel.pp_size=1",
                "parallel.sequence_parallel=false",
                "rollout.engine_tp_size=8",
                "rollout.num_engines=16",
            ],
            "train phase needs",
            "use more nodes",
        ),
        (
            ["rollout.engine_tp_size=1", "rollout.num_engines=128"],
            "one SGLang engine's weights alone (61.03 GiB per GPU at rollout.engine_tp_size=1) exceed",
            "rollout.engine_tp_size=2 rollout.num_engines=64",
        ),
    ],
)
def test_plan_refuses_layouts_that_cannot_fit(overrides, reason, suggestion, capsys):
    plan = make_plan(load_config(RECIPE, overrides))
    assert not plan.fits and any(reason in p.message for p in plan.problems), plan.problems
    assert suggestion in plan.suggestion
    assert main(["plan", str(RECIPE), *overrides]) == 2
    err = capsys.readouterr().err
    assert reason in err and "smallest change that fits" in err


def test_plan_checks_that_a_stop_signal_s_save_fits_the_grace_and_the_job_s_lead_time(capsys):
    """The recipe's save (458.7 GB = its parameters x (2 + 12) bytes, written by the 2
    nodes of the first replica) fits in its trainer.stop_grace_s, and that in the 1800 s
    train.sbatch signals ahead; a grace too short for the save, or too long for the lead
    time, is refused naming the key."""
    plan = make_plan(load_config(RECIPE), signal_lead_s=1800)
    assert plan.fits, plan.problems
    assert plan.stop.save_bytes == plan.num_parameters * 14 and plan.stop.writing_nodes == 2
    assert plan.stop.save_s == pytest.approx(plan.stop.save_bytes / 2e9)
    short = make_plan(load_config(RECIPE, ["trainer.stop_grace_s=120"]), signal_lead_s=1800)
    (problem,) = short.problems
    assert "a save of 459 GB takes about 229 s" in problem.message and problem.keys == ("trainer.stop_grace_s",)
    assert main(["plan", str(RECIPE), "--signal-lead-s", "300"]) == 2
    err = capsys.readouterr().err
    assert (
        "trainer.stop_grace_s=1700 plus 90 s to stop the workers exceeds the job's --signal lead time of 300 s" in err
    )
    assert "set trainer.stop_grace_s at most 210" in err
    assert main(["plan", str(RECIPE)]) == 0  # without the lead time only the save is checked
    assert "must fit in trainer.stop_grace_s=1700 s (plan --signal-lead-s checks it" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.tp_size=3", "parallel.num_devices_per_node=6", "parallel.num_nodes=20"],
            "parallel.tp_size=3 must divide model.num_attention_heads=40",
        ),
        (["parallel.pp_size=3", "parallel.num_nodes=24"], "parallel.pp_size=3 must divide model.num_layers=64"),
        (["trainer.micro_batch_max_tokens=16384"], "must hold one full sequence"),
    ],
)
def test_plan_refuses_impossible_layouts(overrides, message, capsys):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)
    assert main(["plan", str(RECIPE), *overrides]) == 2
    assert message in capsys.readouterr().err


def test_the_cpu_example_validates_and_plans_without_overrides(capsys):
    """The demo config, before its prepare step has run: CPU ranks and a transformers engine.
    (``config`` checks that the files it names exist, so before prepare it says to
    prepare: ``tests/unit/test_preflight.py``; ``plan`` needs only the architecture.)"""
    assert main(["plan", str(DEMO)]) == 0
    out = capsys.readouterr().out
    assert "transformers engine" in out and "SGLang" not in out and "GPU" not in out
    assert "this machine: 2 ranks" in out and out.rstrip().endswith("fits")
    plan = make_plan(load_config(DEMO))
    assert plan.fits and plan.host is not None and plan.memory.engine == "hf"
    # By hand: 740,992 parameters (tied, one stage), fp32, dp = 2, on each of 2 ranks.
    params = 3 * ((128 * 128 + 128 + 2 * (128 * 64 + 64)) + 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128 + 16 * 128
    mem = plan.memory
    assert plan.num_parameters == mem.parameters == params == 740_992
    assert (mem.weights, mem.gradients, mem.optimizer) == (4 * params, 4 * params, 8 * params // 2)
    # h * (10 + 24/tp) bytes in bf16, doubled in fp32; and the local attention's softmax of
    # 4 heads over sequences of at most 8 + 6 tokens, 2048 of them per layer, plus the
    # scores buffer.
    assert mem.activations == 3 * 2048 * 128 * 34 * 2 + 3 * 4 * 2048 * 14 * 4 + 4 * 14 * 14 * 4
    # The engine: fp32 weights, and keys and values (3 layers x 2 groups x 32 dims, fp32) for
    # 32 prompts x 8 samples at the full 8 + 6 tokens.
    assert mem.hf_engine_weights == 4 * params
    assert mem.hf_engine_kv_cache == 256 * 14 * (2 * 3 * 2 * 32 * 4)
    assert plan.host.total == 2 * (mem.train_phase) + mem.hf_engine + GIB
    assert mem.train_phase == 4 * params + 4 * params + 4 * params + mem.activations + mem.logprob + GIB


def test_a_cpu_run_that_does_not_fit_is_not_told_to_add_gpu_nodes(capsys):
    overrides = ["data.train_batch_size=4096", "data.gen_batch_size=4096", "rollout.max_response_length=100000"]
    overrides += ["trainer.micro_batch_max_tokens=100008", "algorithm.overlong_buffer_len=4"]
    plan = make_plan(load_config(DEMO, overrides))
    assert not plan.fits and plan.problems[0].message.startswith("the CPU run needs")
    assert "nodes" not in plan.suggestion and "GiB" in plan.suggestion
    assert main(["plan", str(DEMO), *overrides]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: {DEMO} (parallel.tp_size, parallel.pp_size, parallel.num_devices_per_node, rollout.num_engines, "
        "rollout.max_prompt_length, rollout.n_samples_per_prompt) and command line (trainer.micro_batch_max_tokens, "
        "rollout.max_response_length, data.train_batch_size, data.gen_batch_size): layout does not fit: the CPU run"
    ) in err, err


def test_a_transformers_engine_on_gpus_is_planned_as_one(capsys):
    plan = make_plan(load_config(DEMO, ["parallel.device=cuda", "rollout.engine=hf"]))
    assert plan.fits and plan.host is None and plan.memory.engine == "hf"
    assert plan.memory.rollout_phase == (
        plan.memory.weights
        + plan.memory.gradients
        + plan.memory.optimizer
        + plan.memory.hf_engine
        + plan.memory.sync_export
        + 3 * GIB
    )
    with pytest.raises(ConfigError, match="rollout.engine=sglang needs a GPU but parallel.device=cpu"):
        load_config(DEMO, ["rollout.engine=sglang"])


def test_an_engine_whose_weights_alone_do_not_fit_says_so_and_what_would(capsys):
    overrides = ["rollout.engine_tp_size=1", "rollout.num_engines=128", "rollout.gpu_memory_utilization=0.6"]
    assert main(["plan", str(RECIPE), *overrides]) == 2
    out, err = capsys.readouterr()
    assert "KV cache" not in out.split("= train phase")[1]
    assert (
        "SGLang 0.6 x 80 GiB = 48.00 GiB: the weights alone (61.03 GiB per GPU) do not fit; "
        "rollout.engine_tp_size=2 with rollout.num_engines=64 (30.51 GiB of weights per GPU) would"
    ) in out
    assert "error: command line (rollout.num_engines, rollout.engine_tp_size, rollout.gpu_memory_utilization)" in err


def test_plan_counts_the_kl_reference_policy_as_one_more_frozen_copy_of_the_weights(capsys):
    """``algorithm.use_kl_loss``: the reference weights (bf16, the stage's parameters) and
    nothing more (no gradients, no optimizer state), in both phases and in the table."""
    # The recipe's 0.6 leaves 1.2 GiB next to the engines (with a sync in flight): the
    # reference's 3.82 GiB need a smaller SGLang share.
    smaller = "rollout.gpu_memory_utilization=0.55"
    base = make_plan(load_config(RECIPE, [smaller])).memory
    mem = make_plan(load_config(RECIPE, [smaller, "algorithm.use_kl_loss=true"])).memory
    assert base.reference == 0 and mem.reference == 2 * mem.parameters == mem.weights
    assert mem.gradients == base.gradients and mem.optimizer == base.optimizer
    assert mem.train_phase - base.train_phase == mem.reference == mem.rollout_phase - base.rollout_phase
    assert main(["plan", str(RECIPE), "algorithm.use_kl_loss=true"]) == 2
    assert main(["plan", str(RECIPE), smaller, "algorithm.use_kl_loss=true"]) == 0
    assert "KL reference policy (bf16, frozen)    3.82 GiB" in capsys.readouterr().out


def test_plan_cli_prints_the_table(capsys):
    assert main(["plan", str(RECIPE)]) == 0
    out = capsys.readouterr().out
    assert "32,763,876,352 parameters" in out and "train phase" in out and "rollout phase" in out and "fits" in out
    assert "weight-sync q/k/v export buffers    2.19 GiB" in out
    assert "weight-sync staging (2 x 1.45 GiB)    2.90 GiB" in out
    assert "+ weight sync in flight            4.41 GiB" in out
    assert "collective timeout: 30 min (parallel.timeout_minutes)" in out and "never while the engines generate" in out


SCRIPTS = ROOT / "examples" / "qwen2_5_32b"


def test_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    result = subprocess.run(
        [str(shellcheck), "-x", "train.sbatch", "convert.sbatch", "slurm_common.sh"],
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _dry_run(script, *args, **env):
    full_env = {
        **os.environ,
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": "gpu-[007-008]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "99",
        "MODEL_DIR": "/models/Qwen2.5-32B",
        "DATA_DIR": "/data",
        "OUTPUT_DIR": "/runs/dapo",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **env,
    }
    return subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True, env=full_env)


def test_train_dry_run_for_a_two_node_allocation():
    result = _dry_run(  # 2 nodes: dp 1, no optimizer sharding
        "train.sbatch", "rollout.gpu_memory_utilization=0.35", MEGATRON_CKPT="/runs/dapo/qwen2_5_32b_mcore"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    head = [line for line in lines if "ray start --head" in line]
    workers = [line for line in lines if "ray start --address=gpu-007:6379" in line]
    assert len(head) == 1 and "-w gpu-007" in head[0] and "--num-gpus=8" in head[0]
    assert len(workers) == 1 and "-w gpu-008" in workers[0]
    train = [line for line in lines if "dapo-megatron train examples/qwen2_5_32b/dapo.yaml" in line]
    assert len(train) == 1
    for expected in (
        "model.hf_config=/models/Qwen2.5-32B",
        "parallel.num_nodes=2",
        "rollout.num_engines=4",
        "checkpoint.load_dir=/runs/dapo/qwen2_5_32b_mcore",
        "rollout.gpu_memory_utilization=0.35",
        "ray.address=gpu-007:6379",
    ):
        assert expected in train[0]
    plan = [line for line in lines if "dapo-megatron plan" in line]
    assert len(plan) == 1 and lines.index(plan[0]) < lines.index(head[0])
    # Placement rehearsed before Ray starts, on the head node (inside the container, if any).
    assert plan[0].endswith(" --rehearse --spare-nodes 0") and "-w gpu-007" in plan[0]
    assert f"plan {SCRIPTS / 'dapo.yaml'} " in plan[0]
    skipped = _dry_run("train.sbatch", "rollout.gpu_memory_utilization=0.35", REHEARSE="0")
    assert "--rehearse" not in next(line for line in skipped.stdout.splitlines() if "dapo-megatron plan" in line)
    # The layout the dry run would launch is one `plan` accepts (with the shipped model config).
    overrides = train[0].split("dapo.yaml ", 1)[1].replace("\\[", "[").replace("\\]", "]").split()
    overrides = [o for o in overrides if not o.startswith(("model.hf_config=", "model.hf_weights="))]
    assert make_plan(load_config(RECIPE, overrides)).fits
    # The data files: the recipe's, by name, under DATA_DIR; the tokenizer from MODEL_DIR.
    for expected in (
        "data.train_files=\\[/data/dapo-math-17k.parquet\\]",
        "data.val_files=\\[/data/aime-2024.parquet\\]",
        "data.tokenizer=/models/Qwen2.5-32B",
        "model.hf_weights=/models/Qwen2.5-32B",
    ):
        assert f" {expected} " in train[0], expected
    # A fresh run: no --resume; the trainer runs in the background so signals reach it.
    assert "--resume" not in train[0] and "scontrol requeue" not in result.stdout


def test_spare_nodes_hold_separate_engines():
    """ENGINE_NODES=1 of a 3-node allocation: 2 actor nodes, Ray on all 3, 2 separate
    engines of TP 4 on the third node's 8 GPUs, rehearsed with that spare node."""
    result = _dry_run(
        "train.sbatch",
        "rollout.gpu_memory_utilization=0.4",
        SLURM_JOB_NODELIST="gpu-[007-009]",
        SLURM_NNODES="3",
        ENGINE_NODES="1",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line for line in lines if "ray start --address=gpu-007:6379" in line][-1].count("-w gpu-009") == 1
    train = next(line for line in lines if "dapo-megatron train" in line)
    for expected in ("parallel.num_nodes=2", "rollout.colocate=false", "rollout.num_engines=2"):
        assert expected in train
    plan = next(line for line in lines if "dapo-megatron plan" in line)
    assert plan.endswith("--rehearse --spare-nodes 1")
    assert "get('GPU', 0) >= 24" in next(line for line in lines if "ray.cluster_resources" in line).replace("\\", "")
    too_few = _dry_run(
        "train.sbatch", SLURM_JOB_NODELIST="gpu-[007-008]", SLURM_NNODES="2", NUM_NODES="2", ENGINE_NODES="1"
    )
    assert too_few.returncode == 2 and "but the allocation has 2 nodes" in too_few.stderr


def test_a_requeued_job_resumes_the_run_it_finds(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("{}")
    result = _dry_run("train.sbatch", OUTPUT_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    train = [line for line in result.stdout.splitlines() if "dapo-megatron train" in line]
    assert len(train) == 1 and train[0].endswith(" --resume")
    script = (SCRIPTS / "train.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@1800" in script
    assert "trap 'stop_asked USR1' USR1" in script and "(( status == 75 ))" in script


def test_with_a_container_every_command_that_needs_the_package_runs_inside_it():
    """plan, the wait for Ray's GPUs, ray start and train each run through srun with the
    container's flags, the repository mounted at its own path and used as the workdir."""
    result = _dry_run("train.sbatch", CONTAINER_IMAGE="/images/dapo.sqsh")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    repo = str(ROOT)
    for needle in (
        "dapo-megatron plan",
        "ray.cluster_resources",
        "ray start --head",
        "ray start --address",
        "dapo-megatron train",
    ):
        line = next(line for line in lines if needle in line).replace("\\,", ",")  # as printf %q quotes it
        assert line.startswith("+ srun "), line
        assert "--container-image=/images/dapo.sqsh" in line, line
        assert f"--container-mounts={repo},/models/Qwen2.5-32B,/data,/runs/dapo" in line, line
        assert f"--container-workdir={repo}" in line, line
    convert = _dry_run("convert.sbatch", CONTAINER_IMAGE="/images/dapo.sqsh")
    assert convert.returncode == 0, convert.stderr
    assert f"--container-workdir={repo}" in convert.stdout


def test_the_cluster_takes_only_this_jobs_token():
    result = _dry_run("train.sbatch")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    head = next(line for line in lines if "ray start --head" in line)
    assert "--include-dashboard=false" in head
    assert lines.index("+ make_ray_token") < lines.index(head)
    script = (SCRIPTS / "train.sbatch").read_text()
    assert "umask 077" in script and 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RAY_TOKEN_FILE"' in script


def test_convert_dry_run_and_missing_settings():
    result = _dry_run("convert.sbatch", "--verify")
    assert result.returncode == 0, result.stderr
    assert (
        "dapo-megatron convert hf-to-megatron --hf-dir /models/Qwen2.5-32B --out /runs/dapo/qwen2_5_32b_mcore --verify"
        in (result.stdout)
    )
    missing = _dry_run("train.sbatch", OUTPUT_DIR="")
    assert missing.returncode != 0 and "set OUTPUT_DIR" in missing.stderr
    # Without MODEL_DIR, the recipe's own model: the demo's (runs/demo/base, made by `make demo`).
    demo = _dry_run("convert.sbatch", RECIPE="examples/demo/demo.yaml", MODEL_DIR="")
    assert demo.returncode == 0, demo.stderr
    assert f"--hf-dir {ROOT / 'runs' / 'demo' / 'base'} --out /runs/dapo/demo_mcore" in demo.stdout


def _cpu_demo(**env):
    """The dry run of `sbatch --nodes=1 --gpus-per-node=0 --export=ALL,RECIPE=examples/demo/demo.yaml,...`."""
    settings = {
        "RECIPE": "examples/demo/demo.yaml",
        "SLURM_JOB_NODELIST": "cpu-001",
        "SLURM_NNODES": "1",
        "SLURM_GPUS_PER_NODE": "0",
        "SLURM_CPUS_ON_NODE": "2",
        "MODEL_DIR": "",
        "DATA_DIR": "",
        **env,
    }
    result = _dry_run("train.sbatch", **settings)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_cpu_recipe_runs_with_its_own_model_data_and_layout(tmp_path):
    """The demo recipe on one node without GPUs: no MODEL_DIR or DATA_DIR needed (the
    recipe's model, tokenizer and JSONL data), no converted checkpoint (the trainer
    converts on load), the recipe's 2 ranks and 1 engine kept (no GPU counts forced on
    it), and Ray declaring CPUs for them and the driver (max(node CPUs, 2 + 1 + 1)), the
    wait counting CPUs."""
    lines = _cpu_demo(OUTPUT_DIR=str(tmp_path))
    train = next(line for line in lines if "dapo-megatron train" in line)
    overrides = train.split("examples/demo/demo.yaml ", 1)[1].split()
    assert overrides == [f"trainer.output_dir={tmp_path}", "parallel.num_nodes=1", "ray.address=cpu-001:6379"]
    head = next(line for line in lines if "ray start --head" in line)
    assert "--num-cpus=4 --num-gpus=0" in head
    assert "get('CPU', 0) >= 4" in next(line for line in lines if "ray.cluster_resources" in line).replace("\\", "")
    assert "parquet" not in "\n".join(lines)
    more = _cpu_demo(
        OUTPUT_DIR=str(tmp_path),
        SLURM_CPUS_ON_NODE="64",
        ENGINE_NODES="1",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="cpu-[001-002]",
    )
    train = next(line for line in more if "dapo-megatron train" in line)
    assert "rollout.colocate=false" in train and "rollout.num_engines" not in train
    assert all("--num-cpus=64 --num-gpus=0" in line for line in more if "ray start" in line)


def test_a_converted_checkpoint_is_loaded_only_when_there_is_one(tmp_path):
    assert not any("checkpoint.load_dir" in line for line in _cpu_demo(OUTPUT_DIR=str(tmp_path)))
    (tmp_path / "demo_mcore").mkdir()  # convert.sbatch's default output
    train = next(line for line in _cpu_demo(OUTPUT_DIR=str(tmp_path)) if "dapo-megatron train" in line)
    assert f"checkpoint.load_dir={tmp_path / 'demo_mcore'}" in train
    given = _cpu_demo(OUTPUT_DIR=str(tmp_path), MEGATRON_CKPT="/elsewhere/ckpt")
    assert "checkpoint.load_dir=/elsewhere/ckpt" in next(line for line in given if "dapo-megatron train" in line)


def test_model_dir_and_data_dir_keep_the_recipes_file_names(tmp_path):
    lines = _cpu_demo(OUTPUT_DIR=str(tmp_path), MODEL_DIR="/m", DATA_DIR="/d")
    train = next(line for line in lines if "dapo-megatron train" in line).replace("\\", "")
    for expected in ("model.hf_config=/m", "model.hf_weights=/m", "data.tokenizer=/m"):
        assert expected in train
    assert "data.train_files=[/d/train.jsonl]" in train and "data.val_files=[/d/val.jsonl]" in train


def test_a_gpu_recipe_without_gpus_is_refused():
    result = _dry_run("train.sbatch", SLURM_GPUS_PER_NODE="0")
    assert result.returncode == 2 and "runs on GPUs (parallel.device=cuda) but the job has none" in result.stderr
    # The job's GPUs, as sbatch gives them, set the node's devices.
    four = _dry_run(
        "train.sbatch",
        "rollout.gpu_memory_utilization=0.35",
        SLURM_GPUS_PER_NODE="h100:4",
        SLURM_JOB_NODELIST="gpu-[001-004]",
        SLURM_NNODES="4",
    )
    assert four.returncode == 0, four.stderr
    train = next(line for line in four.stdout.splitlines() if "dapo-megatron train" in line)
    assert "parallel.num_devices_per_node=4" in train and "rollout.num_engines=4" in train


def test_plan_counts_the_score_squares_of_megatron_s_local_attention():
    """Flash attention (Transformer Engine, the recipe's GPU default) keeps no score
    square; megatron's local attention keeps each sequence's ``[heads / tp, L, L]`` softmax
    for backward: at most budget x longest sequence per layer, for every layer in flight
    without recompute and one layer with it, plus megatron's scores buffer."""
    flash = estimate_memory(load_config(RECIPE))
    local = estimate_memory(load_config(RECIPE, ["model.transformer_impl=local"]))
    cfg = load_config(RECIPE)
    m, p, t, r = cfg.model, cfg.parallel, cfg.trainer, cfg.rollout
    longest = min(r.max_prompt_length + r.max_response_length, t.micro_batch_max_tokens)
    heads = m.num_attention_heads / p.tp_size
    per_layer = heads * t.micro_batch_max_tokens * longest * 2
    buffer = heads * longest * longest * 2
    layers = m.num_layers // p.pp_size  # 64 / 2, the heaviest stage
    assert local.activations_recompute - flash.activations_recompute == int(per_layer + buffer)
    assert local.activations_no_recompute - flash.activations_no_recompute == int(
        per_layer * layers * p.pp_size + buffer
    )
    assert local.activations_recompute - flash.activations_recompute > 5 * GIB  # 40 / 8 heads, 32k x 22.5k tokens
