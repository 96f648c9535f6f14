"""Config: strict YAML loading, overrides with coercion, HF shape reading, layout rules, CLI."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dapo_megatron import config as config_module
from dapo_megatron.cli import main
from dapo_megatron.config import Config, ConfigError, load_config, padded_vocab_size

TINY = Path(__file__).parent.parent / "data" / "tiny_run.yaml"
QWEN_32B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "max_position_embeddings": 131072,
    "model_type": "qwen2",
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}


def write_yaml(tmp_path: Path, data: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def tiny(**sections) -> dict:
    data = yaml.safe_load(TINY.read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def qwen32b_run(tmp_path: Path, **parallel) -> dict:
    (tmp_path / "qwen").mkdir(exist_ok=True)
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(QWEN_32B))
    data = tiny(parallel={"num_devices_per_node": 8, "tp_size": 8, "pp_size": 1, **parallel})
    data["model"] = {"hf_config": str(tmp_path / "qwen")}
    return data


def error_of(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_tiny_config_loads_with_typed_values():
    cfg = load_config(TINY)
    assert cfg.parallel.tp_size == 2 and cfg.parallel.world_size == 4
    # PyYAML reads `1e-6` as a string; a float field takes it as the number.
    assert cfg.trainer.lr == 1e-6 and isinstance(cfg.trainer.lr, float)
    assert cfg.algorithm.clip_ratio_c == 3.0
    assert cfg.model.tie_word_embeddings is True
    assert cfg.algorithm.clip_ratio_low == 0.2 and cfg.algorithm.clip_ratio_high == 0.28


def test_yaml_round_trip(tmp_path):
    cfg = load_config(TINY, ["trainer.lr=3e-4", "data.train_files=[a.parquet, b.parquet]"])
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(cfg.to_yaml())
    again = load_config(dumped)
    assert again == cfg
    assert again.to_yaml() == cfg.to_yaml()


def test_unknown_key_names_file_and_key(tmp_path):
    path = write_yaml(tmp_path, tiny(parallel={"tp_sizee": 2}))
    message = error_of(path)
    assert message.startswith(f"{path}: unknown key 'parallel.tp_sizee'")
    assert "tp_size" in message  # lists the known keys


def test_unknown_section(tmp_path):
    data = tiny()
    data["optimizer"] = {"lr": 1.0}
    message = error_of(write_yaml(tmp_path, data))
    assert "unknown key 'optimizer'" in message and "trainer" in message


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("parallel", "tp_size", "two", "expected int, found str"),
        ("parallel", "tp_size", 2.5, "expected int, found float"),
        ("parallel", "pp_size", True, "expected int, found bool"),
        ("logging", "tensorboard", "yes please", "expected bool, found str"),
        ("algorithm", "loss_agg_mode", "sample-mean", "expected 'token-mean' | 'seq-mean-token-mean'"),
        ("data", "train_files", 3, "expected list of str, found int"),
        ("trainer", "lr", "fast", "expected float, found str"),
    ],
)
def test_wrong_type(tmp_path, section, key, value, expected):
    path = write_yaml(tmp_path, tiny(**{section: {key: value}}))
    message = error_of(path)
    assert f"{path}: {section}.{key}={value!r} has the wrong type" in message
    assert expected in message


def test_section_must_be_mapping(tmp_path):
    data = tiny()
    data["parallel"] = [1, 2]
    assert "parallel must be a mapping" in error_of(write_yaml(tmp_path, data))


def test_tp_must_divide_heads(tmp_path):
    path = write_yaml(tmp_path, qwen32b_run(tmp_path, tp_size=3, num_devices_per_node=3))
    assert error_of(path) == (
        f"{path}: parallel.tp_size=3 must divide model.num_attention_heads=40; nearest valid parallel.tp_size: 2 or 4"
    )


def test_tp_must_divide_query_groups(tmp_path):
    # 40 heads split over tp=5, but 8 KV heads do not.
    path = write_yaml(tmp_path, qwen32b_run(tmp_path, tp_size=5, num_devices_per_node=5))
    assert error_of(path) == (
        f"{path}: parallel.tp_size=5 must divide model.num_query_groups=8; nearest valid parallel.tp_size: 4 or 8"
    )


def test_world_size_must_equal_product(tmp_path):
    path = write_yaml(tmp_path, tiny(parallel={"dp_size": 2}))
    message = error_of(path)
    assert "world size 4" in message and "tp_size*pp_size*dp_size*cp_size=2*2*2*1=8" in message


def test_world_size_must_be_divisible_when_dp_derived(tmp_path):
    path = write_yaml(tmp_path, tiny(parallel={"num_devices_per_node": 6}))
    assert "world size 6" in error_of(path) and "must be divisible by tp_size*pp_size*cp_size" in error_of(path)


def test_layers_must_split_over_pp(tmp_path):
    path = write_yaml(tmp_path, tiny(parallel={"pp_size": 3, "tp_size": 1, "num_devices_per_node": 3}))
    message = error_of(path)
    assert message.startswith(f"{path}: parallel.pp_size=3 must divide model.num_layers=4")
    assert "num_layers_in_first_pipeline_stage" in message


def test_uneven_pipeline_split_when_configured(tmp_path):
    path = write_yaml(
        tmp_path,
        tiny(parallel={"pp_size": 3, "tp_size": 1, "num_devices_per_node": 3, "num_layers_in_first_pipeline_stage": 2}),
    )
    cfg = load_config(path)
    assert cfg.parallel.stage_layers(cfg.model.num_layers) == [2, 1, 1]


def test_uneven_pipeline_split_that_does_not_add_up(tmp_path):
    path = write_yaml(
        tmp_path,
        tiny(parallel={"pp_size": 3, "tp_size": 1, "num_devices_per_node": 3, "num_layers_in_last_pipeline_stage": 3}),
    )
    assert "must split evenly over the remaining stages" in error_of(path)


def test_mini_batch_must_divide_responses(tmp_path):
    path = write_yaml(tmp_path, tiny(data={"mini_batch_size": 12}))
    assert "data.mini_batch_size=12 must divide data.train_batch_size x rollout.n_samples_per_prompt = 8 x 4 = 32" in (
        error_of(path)
    )


def test_sequence_parallel_needs_tensor_parallelism():
    message = error_of(TINY, ["parallel.sequence_parallel=true", "parallel.tp_size=1"])
    assert message == "command line: parallel.sequence_parallel=true needs parallel.tp_size > 1"
    assert load_config(TINY, ["parallel.sequence_parallel=true"]).parallel.sequence_parallel  # tp 2, CPU norms


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 48,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


def _moe_run(tmp_path, **hf) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, **hf}))
    run = tmp_path / "run.yaml"
    run.write_text(
        "model: {hf_config: config.json}\n"
        "parallel: {device: cpu, num_devices_per_node: 8, tp_size: 2, sequence_parallel: true, ep_size: 4}\n"
        "rollout: {engine: hf}\n"
    )
    return run


def test_qwen3_moe_shape_and_router_defaults_come_from_config_json(tmp_path):
    cfg = load_config(_moe_run(tmp_path))
    m = cfg.model
    assert (m.family, m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == ("qwen3_moe", 128, 8, 768)
    assert m.moe_norm_topk_prob is True and m.mlp_only_layers == [] and m.decoder_sparse_step == 1
    # The HF config's output_router_logits is off (Qwen3-30B-A3B's, and transformers'
    # default): HF trains with no load-balancing loss, so neither does the default here.
    assert m.moe_aux_loss_coeff == 0.0 and m.moe_z_loss_coeff == 0.0
    # A coefficient set by the user is kept (it is a setting, not part of the shape).
    assert load_config(_moe_run(tmp_path), ["model.moe_aux_loss_coeff=0"]).model.moe_aux_loss_coeff == 0.0
    # transformers 5 writes num_local_experts.
    hf = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_local_experts": 64}))
    assert load_config(tmp_path / "run.yaml").model.num_experts == 64


def test_the_load_balancing_default_weighs_the_loss_as_the_hf_config_does(tmp_path):
    """HF adds router_aux_loss_coef x one loss pooled over the MoE layers (k for balanced
    routing), and only with output_router_logits; megatron adds its coefficient x a loss
    per MoE layer (1 each when balanced), summed. The default is the per-layer value with
    HF's weight: router_aux_loss_coef x top-k / MoE layers, 0 when HF has it off."""
    assert load_config(_moe_run(tmp_path, output_router_logits=False)).model.moe_aux_loss_coeff == 0.0
    on = load_config(_moe_run(tmp_path, output_router_logits=True)).model
    assert on.moe_aux_loss_coeff == pytest.approx(0.001 * 8 / 48, rel=1e-12)  # 1.667e-4, not 0.001
    # Dense layers carry no router: only the MoE layers count.
    dense_two = load_config(_moe_run(tmp_path, output_router_logits=True, mlp_only_layers=[0, 47])).model
    assert dense_two.moe_aux_loss_coeff == pytest.approx(0.001 * 8 / 46, rel=1e-12)
    every_other = load_config(_moe_run(tmp_path, output_router_logits=True, decoder_sparse_step=2)).model
    assert every_other.moe_aux_loss_coeff == pytest.approx(0.001 * 8 / 24, rel=1e-12)
    # Set by hand it is megatron's per-layer coefficient, taken as given.
    assert load_config(_moe_run(tmp_path), ["model.moe_aux_loss_coeff=0.01"]).model.moe_aux_loss_coeff == 0.01


def test_expert_settings_on_a_dense_family_are_refused_naming_the_key_and_the_family(tmp_path):
    """A dense model (qwen2, qwen3) has no router: a mixture-of-experts key set on one
    would be accepted and do nothing. Each is refused, naming where it was set, the key,
    its value and the family; values a dense model's config holds anyway (unset experts,
    router losses 0, as the resolved config written into a run folder has them) load."""
    run = write_yaml(tmp_path, tiny())
    assert error_of(run, ["model.num_experts=8"]) == (
        "command line: model.num_experts=8 would be ignored: model.family='qwen2' is a dense family with no "
        "experts (mixture-of-experts families: qwen3_moe); remove model.num_experts, or point model.hf_config "
        "at a mixture-of-experts model"
    )
    for override in (
        "model.moe_aux_loss_coeff=0.3",
        "model.moe_z_loss_coeff=0.5",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=16",
        "model.moe_norm_topk_prob=false",
        "model.decoder_sparse_step=2",
        "model.mlp_only_layers=[0]",
        "model.routing_replay=rollout",
    ):
        key = override.split("=")[0]
        message = error_of(run, [override])
        assert message.startswith(f"command line: {key}=") and f"remove {key}," in message, message
        assert "model.family='qwen2'" in message
    # Several at once, set in the file: all named, with the file as the source.
    data = tiny(model={"moe_aux_loss_coeff": 0.3, "moe_z_loss_coeff": 0.5, "num_experts": 8})
    message = error_of(write_yaml(tmp_path, data, "dense.yaml"))
    assert message.startswith(f"{tmp_path / 'dense.yaml'}: model.num_experts=8, model.moe_aux_loss_coeff=0.3, ")
    assert "remove model.num_experts, model.moe_aux_loss_coeff, model.moe_z_loss_coeff," in message
    # qwen3, read from a config.json: the family is named.
    dense = {k: v for k, v in QWEN3_MOE.items() if k not in ("moe_intermediate_size", "num_experts")}
    (tmp_path / "qwen3.json").write_text(json.dumps({**dense, "model_type": "qwen3"}))
    qwen3 = tmp_path / "qwen3.yaml"
    qwen3.write_text(
        "model: {hf_config: qwen3.json, moe_z_loss_coeff: 0.001}\n"
        "parallel: {device: cpu, num_devices_per_node: 8, tp_size: 2}\nrollout: {engine: hf}\n"
    )
    assert error_of(qwen3).startswith(f"{qwen3}: model.moe_z_loss_coeff=0.001 would be ignored: model.family='qwen3'")
    # Not tripped by defaults, by config.json's keys a dense model ignores
    # (num_experts_per_tok, router_aux_loss_coef above), by the coefficients' "off", or by a
    # resolved config written back; an MoE family takes every one of the keys.
    assert load_config(qwen3, ["model.moe_z_loss_coeff=0"]).model.family == "qwen3"
    cfg = load_config(run, ["model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0.0"])
    (tmp_path / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "resolved.yaml") == cfg
    assert (cfg.model.num_experts, cfg.model.moe_aux_loss_coeff, cfg.model.moe_z_loss_coeff) == (None, 0.0, 0.0)
    moe = load_config(_moe_run(tmp_path), ["model.moe_z_loss_coeff=0.5", "model.moe_aux_loss_coeff=0.3"]).model
    assert (moe.moe_z_loss_coeff, moe.moe_aux_loss_coeff, moe.num_experts) == (0.5, 0.3, 128)


def test_expert_parallel_size_is_checked_with_the_nearest_valid_values(tmp_path):
    run = _moe_run(tmp_path)
    assert error_of(run, ["parallel.ep_size=3"]) == (
        "command line: parallel.ep_size=3 must divide model.num_experts=128; nearest valid parallel.ep_size: 2 or 4"
    )
    # 8 ranks at tp 2: a stage has tp * dp = 8 ranks, so ep 16 divides the experts but not the stage.
    message = error_of(run, ["parallel.ep_size=16"])
    assert "parallel.ep_size=16 must divide the ranks of a pipeline stage, tp_size*cp_size*dp_size=2*1*4=8" in message
    assert message.endswith("nearest valid parallel.ep_size: 8")
    assert "needs parallel.sequence_parallel=true" in error_of(run, ["parallel.sequence_parallel=false"])
    assert "needs a mixture-of-experts model" in error_of(TINY, ["parallel.ep_size=2"])
    assert load_config(_moe_run(tmp_path, mlp_only_layers=[0], decoder_sparse_step=2)).model.mlp_only_layers == [0]
    assert "names layers [48] outside 0..47" in error_of(_moe_run(tmp_path, mlp_only_layers=[48]))
    assert "exceeds model.num_experts=128" in error_of(_moe_run(tmp_path, num_experts_per_tok=200))


def test_routing_replay_values_and_what_they_need(tmp_path):
    run = _moe_run(tmp_path)
    assert load_config(run, ["model.routing_replay=rollout"]).model.routing_replay == "rollout"
    assert "model.routing_replay" in error_of(run, ["model.routing_replay=engine"])
    message = error_of(run, ["model.routing_replay=old", "algorithm.use_rollout_log_probs=true"])
    assert "model.routing_replay=old replays the routing of the actor's old-log-prob pass" in message
    assert load_config(run, ["model.routing_replay=rollout", "algorithm.use_rollout_log_probs=true"])


def test_overrides_with_type_coercion():
    cfg = load_config(
        TINY,
        [
            "parallel.tp_size=1",
            "parallel.pp_size=4",
            "trainer.lr=2e-5",
            "algorithm.clip_ratio_c=null",
            "logging.tensorboard=false",
            "data.prompt_key=123",
            "data.train_files=[x.parquet, y.parquet]",
            "data.val_files=only.parquet",
            "model.make_vocab_size_divisible_by=64",
        ],
    )
    assert cfg.parallel.tp_size == 1 and cfg.parallel.pp_size == 4
    assert cfg.trainer.lr == 2e-5
    assert cfg.algorithm.clip_ratio_c is None
    assert cfg.logging.tensorboard is False
    assert cfg.data.prompt_key == "123"
    assert cfg.data.train_files == [str(Path.cwd() / "x.parquet"), str(Path.cwd() / "y.parquet")]
    assert cfg.data.val_files == [str(Path.cwd() / "only.parquet")]
    assert cfg.model.make_vocab_size_divisible_by == 64


def test_divisibility_errors_suggest_the_nearest_valid_values_and_blame_every_source(tmp_path):
    path = write_yaml(tmp_path, tiny())  # tp 2, pp 2, 4 ranks, 4 layers, 8 heads / 4 groups
    message = error_of(path, ["parallel.num_devices_per_node=6"])
    assert message.startswith(
        f"{path} (parallel.tp_size, parallel.pp_size) and command line (parallel.num_devices_per_node): world size 6 "
    ), message
    assert message.endswith("must be divisible by tp_size*pp_size*cp_size=2*2*1=4; nearest valid parallel.tp_size: 1")
    assert error_of(path, ["parallel.pp_size=3", "parallel.num_devices_per_node=6"]).endswith(
        "parallel.pp_size=3 must divide model.num_layers=4 (or set parallel.num_layers_in_first_pipeline_stage / "
        "num_layers_in_last_pipeline_stage); nearest valid parallel.pp_size: 2 or 4"
    )
    # 8 prompts x 4 responses = 32; dp = 2 (8 ranks / tp 2 / pp 2).
    message = error_of(path, ["data.mini_batch_size=12", "parallel.num_devices_per_node=8"])
    assert message == (
        f"command line (data.mini_batch_size) and {path} (data.train_batch_size, rollout.n_samples_per_prompt): "
        "data.mini_batch_size=12 must divide data.train_batch_size x "
        "rollout.n_samples_per_prompt = 8 x 4 = 32; nearest valid data.mini_batch_size: 8 or 16"
    )
    # A command-line change to a value the file's key is checked against is blamed on both.
    message = error_of(path, ["data.train_batch_size=5"])
    assert message.startswith(f"{path} (data.mini_batch_size, rollout.n_samples_per_prompt) and command line"), message
    assert message.endswith("nearest valid data.mini_batch_size: 10 or 20")
    message = error_of(path, ["parallel.dp_size=3"])
    assert message.startswith("command line (parallel.dp_size) and ") and message.endswith(
        "with this tp, pp and cp: parallel.dp_size=1 (or unset it)"
    )


def test_relative_paths_in_a_file_are_relative_to_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs" / "nested"
    folder.mkdir(parents=True)
    (folder / "qwen").mkdir()
    (folder / "qwen" / "config.json").write_text(json.dumps(QWEN_32B))
    data = qwen32b_run(tmp_path)
    data["model"] = {"hf_config": "qwen"}
    data["data"].update(train_files=["data/train.parquet", "/abs/val.parquet"], tokenizer="~/tok")
    data["trainer"].update(output_dir="../runs/a")
    data["checkpoint"] = {"load_dir": "ckpt"}
    path = write_yaml(folder, data)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(Path("..") / "configs" / "nested" / "run.yaml", ["checkpoint.save_dir=saves"])
    assert cfg.model.hf_config == str(folder / "qwen") and cfg.model.num_layers == 64
    assert cfg.data.train_files == [str(folder / "data" / "train.parquet"), "/abs/val.parquet"]
    assert cfg.data.tokenizer == str(Path.home() / "tok")
    assert cfg.trainer.output_dir == str(tmp_path / "configs" / "runs" / "a")
    assert cfg.checkpoint.load_dir == str(folder / "ckpt")
    # Command-line paths are relative to the current directory; unset ones stay unset.
    assert cfg.checkpoint.save_dir == str(elsewhere / "saves")
    assert load_config(path).checkpoint.save_dir is None
    # The resolved config loads again, from anywhere, to the same paths.
    (elsewhere / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(elsewhere / "resolved.yaml") == cfg


def test_a_missing_path_error_shows_the_resolved_path_and_its_source(tmp_path, monkeypatch):
    data = tiny()
    data["model"] = {"hf_config": "missing_model"}
    path = write_yaml(tmp_path, data)
    monkeypatch.chdir("/")
    message = error_of(path)
    assert message.startswith(f"{path}: model.hf_config='{tmp_path / 'missing_model'}'"), message
    assert "relative to its folder" in message
    message = error_of(path, ["model.hf_config=other"])
    assert message.startswith("command line: model.hf_config='/other'"), message


def test_override_errors_name_the_command_line():
    assert error_of(TINY, ["parallel.tp=2"]).startswith("command line: unknown key 'parallel.tp'")
    assert error_of(TINY, ["parallel.tp_size=two"]) == (
        "command line: parallel.tp_size=two has the wrong type: expected int"
    )
    assert "must look like section.key=value" in error_of(TINY, ["parallel.tp_size"])
    assert "is a section" in error_of(TINY, ["parallel=1"])
    # An override that breaks a layout rule is blamed on the command line (and on the file
    # that set the value it is checked against).
    assert error_of(TINY, ["parallel.tp_size=3", "parallel.num_devices_per_node=6"]) == (
        f"command line (parallel.tp_size) and {TINY} (model.num_attention_heads): "
        "parallel.tp_size=3 must divide model.num_attention_heads=8; "
        "nearest valid parallel.tp_size: 2 or 4"
    )


def test_model_shape_from_hf_config_both_rope_spellings(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=12345.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path / "hf5")
    saved = json.loads((tmp_path / "hf5" / "config.json").read_text())
    old_style = dict(QWEN_32B)
    (tmp_path / "hf4").mkdir()
    (tmp_path / "hf4" / "config.json").write_text(json.dumps(old_style))
    new = config_module.read_hf_model_shape(tmp_path / "hf5")
    old = config_module.read_hf_model_shape(tmp_path / "hf4" / "config.json")
    assert new["rope_theta"] == 12345.0 and new["num_query_groups"] == 2 and new["tie_word_embeddings"] is True
    assert saved.get("rope_theta") is None or saved["rope_theta"] == 12345.0
    assert old["rope_theta"] == 1e6 and old["num_layers"] == 64 and old["ffn_hidden_size"] == 27648


def test_hf_shape_conflict_and_unsupported_architecture(tmp_path):
    data = qwen32b_run(tmp_path)
    data["model"]["num_layers"] = 48
    message = error_of(write_yaml(tmp_path, data))
    assert "model.num_layers=48 disagrees with num_hidden_layers=64" in message
    bad = dict(QWEN_32B, architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(bad))
    data = qwen32b_run(tmp_path)
    data["model"]["hf_config"] = str(tmp_path / "llama")
    message = error_of(write_yaml(tmp_path, data, "llama.yaml"))
    assert "unsupported model family 'llama' (config.json's model_type)" in message
    assert "supported: qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM)" in message


def test_incomplete_model_shape(tmp_path):
    data = tiny()
    del data["model"]["hidden_size"]
    assert "model.hidden_size unset" in error_of(write_yaml(tmp_path, data))


def test_padded_vocab_size():
    assert padded_vocab_size(152064, 128, 8) == 152576
    assert padded_vocab_size(152064, 128, 2) == 152064
    assert padded_vocab_size(1000, 128, 2) == 1024


def test_every_field_has_a_docstring():
    sections = [c for c in vars(config_module).values() if dataclasses.is_dataclass(c) and isinstance(c, type)]
    assert Config in sections and len(sections) == 10
    nodes = [
        node
        for module in {inspect.getsourcefile(c) for c in sections}
        for node in ast.parse(Path(module).read_text()).body
    ]
    checked = set()
    for node in nodes:
        if not (isinstance(node, ast.ClassDef) and any(node.name == c.__name__ for c in sections)):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                following = body[i + 1] if i + 1 < len(body) else None
                is_doc = isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant)
                assert is_doc, f"{node.name}.{stmt.target.id} has no docstring"
        checked.add(node.name)
    assert checked == {c.__name__ for c in sections}


def test_cli_config_prints_resolved_yaml(capsys):
    assert main(["config", str(TINY), "parallel.tp_size=4", "parallel.pp_size=1"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["parallel"]["tp_size"] == 4 and printed["trainer"]["lr"] == 1e-6


def test_cli_refuses_with_exit_status_2(tmp_path, capsys):
    path = write_yaml(tmp_path, tiny(parallel={"tp_size": 3, "num_devices_per_node": 6}))
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: parallel.tp_size=3 must divide model.num_attention_heads=8" in err


def test_console_script_help_and_exit_status(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "dapo_megatron", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "config" in ok.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "dapo_megatron", "config", str(tmp_path / "nope.yaml")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "nope.yaml: cannot read config file" in missing.stderr


def test_rollout_correction_settings_are_checked(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny(algorithm={"rollout_correction": "tis", "rollout_correction_cap": 1.0})))
    assert "algorithm.rollout_correction_cap=1.0 must be > 1" in error_of(path)
    assert "expected 'auto' | 'none' | 'tis' | 'mis'" in error_of(
        path, ["algorithm.rollout_correction=is", "algorithm.rollout_correction_cap=2"]
    )
    message = error_of(path, ["algorithm.rollout_correction_cap=2", "algorithm.use_rollout_log_probs=true"])
    assert "algorithm.rollout_correction=tis weighs by exp(old - rollout), which is 1" in message
    config = load_config(path, ["algorithm.rollout_correction_cap=2", "algorithm.rollout_correction_level=sequence"])
    assert (config.algorithm.rollout_correction, config.algorithm.rollout_correction_level) == ("tis", "sequence")


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["rollout.carry_over=true"], "rollout.carry_over=true works on streamed generation"),
        (["rollout.partial_rollout=true"], "rollout.partial_rollout=true works on streamed generation"),
        (["rollout.streaming=true", "trainer.async_generation=true"], "do not combine"),
        (["rollout.streaming=true", "rollout.max_prompts_in_flight=-1"], "rollout.max_prompts_in_flight=-1"),
        (
            ["rollout.streaming=true", "rollout.stream_chunk_tokens=0"],
            "rollout.stream_chunk_tokens=0 must be at least 1",
        ),
        (["rollout.stream_chunk_tokens=8"], "rollout.stream_chunk_tokens=8 acts only on streamed generation"),
        (["rollout.max_prompts_in_flight=8"], "rollout.max_prompts_in_flight=8 acts only on streamed generation"),
        (["rollout.streaming=true", "rollout.max_staleness=3"], "rollout.max_staleness=3 acts only on carried"),
        (
            ["rollout.streaming=true", "rollout.carry_over=true", "rollout.max_staleness=0"],
            "rollout.max_staleness=0 must be >= 1",
        ),
    ],
)
def test_streaming_switches_are_checked_against_each_other(overrides, named):
    assert named in error_of(TINY, overrides)


def test_carried_and_partial_batches_are_corrected_by_default():

    assert load_config(TINY, ["rollout.streaming=true"]).rollout_correction_in_effect == "none"
    for switch in ("carry_over", "partial_rollout"):
        config = load_config(TINY, ["rollout.streaming=true", f"rollout.{switch}=true"])
        assert config.rollout_correction_in_effect == "tis"


def test_reward_worker_memory_cap_is_at_least_0(tmp_path):
    assert "algorithm.reward_worker_memory_mb=-1 must be >= 0 (0 = no cap)" in error_of(
        write_yaml(tmp_path, tiny(algorithm={"reward_worker_memory_mb": -1}))
    )
    assert (
        load_config(
            write_yaml(tmp_path, tiny(algorithm={"reward_worker_memory_mb": 0}))
        ).algorithm.reward_worker_memory_mb
        == 0
    )


def _one_sequence_run(tmp_path, budget: int, name: str = "fits.yaml", **parallel) -> Path:
    data = tiny(
        parallel={"num_devices_per_node": 4, "tp_size": 4, "pp_size": 1, "sequence_parallel": True, **parallel},
        rollout={"max_prompt_length": 61, "max_response_length": 128},
        trainer={"micro_batch_max_tokens": budget},
    )
    return write_yaml(tmp_path, data, name)


def test_one_full_sequence_must_fit_a_micro_batch_after_the_actors_rounding(tmp_path):
    """The longest sequence (61 + 128 = 189 tokens) at tp 4 with sequence parallelism is a
    192-token row for the actor; a budget of 189 validated and then failed at the first
    train step, after a whole generation. Refused at validation, with the rounding named;
    192 is accepted; validation and both planners decide alike, by the same functions."""
    message = error_of(_one_sequence_run(tmp_path, 189))
    assert message == (
        f"{tmp_path / 'fits.yaml'}: trainer.micro_batch_max_tokens=189 must hold one full sequence: "
        "rollout.max_prompt_length + rollout.max_response_length = 189 tokens, a row of 192 once rounded up to "
        "the sequence pad multiple 4 (parallel.tp_size=4 with parallel.sequence_parallel=true); set "
        "trainer.micro_batch_max_tokens to at least 192"
    )
    assert load_config(_one_sequence_run(tmp_path, 192)).trainer.micro_batch_max_tokens == 192
    # Without sequence parallelism nothing is rounded: 189 holds the sequence.
    assert load_config(_one_sequence_run(tmp_path, 189, sequence_parallel=False)).parallel.tp_size == 4
    assert "a row of" not in error_of(_one_sequence_run(tmp_path, 188, sequence_parallel=False))
    # fp8 rounds each tensor-parallel rank's share to 16 tokens: a multiple of 64 at tp 4.
    fp8 = _one_sequence_run(tmp_path, 191, "fp8.yaml", device="cuda")
    assert error_of(fp8, ["model.fp8=true"]).endswith(
        "a row of 192 once rounded up to the sequence pad multiple 64 (parallel.tp_size=4 with model.fp8=true); "
        "set trainer.micro_batch_max_tokens to at least 192"
    )
    # The actor's functions are validation's (one rounding, not two copies of it) ...
    from dapo_megatron.actor import batch, megatron_actor, packing
    from dapo_megatron.config import layout as sequence_pad

    assert megatron_actor.sequence_pad_multiple is sequence_pad.sequence_pad_multiple
    assert megatron_actor.round_up is packing.round_up is batch.round_up is sequence_pad.round_up
    # ... and validation refuses exactly the budgets with which the planners would raise.
    for tp, sequence_parallel in ((4, True), (2, True), (4, False), (1, False)):
        pad = megatron_actor.sequence_pad_multiple(tp, sequence_parallel, False)
        for budget in range(186, 198):
            run = _one_sequence_run(
                tmp_path,
                budget,
                f"run_{tp}_{sequence_parallel}_{budget}.yaml",
                tp_size=tp,
                sequence_parallel=sequence_parallel,
                num_devices_per_node=tp,
            )
            try:
                load_config(run)
                refused = False
            except ConfigError:
                refused = True
            for planner in (packing.plan_packed_micro_batches, batch.plan_micro_batches):
                try:
                    planner([189, 60], budget, pad)
                    raised = False
                except ValueError:
                    raised = True
                assert raised == refused, (tp, sequence_parallel, budget, planner.__name__)
