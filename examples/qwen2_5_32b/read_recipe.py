"""What train.sbatch and convert.sbatch need to know of a recipe, resolved as the trainer
resolves it (``dapo_megatron.config.load_config``):

    python3 read_recipe.py RECIPE [section.key=value ...]

prints ``name=value`` lines: ``device``, ``num_nodes``, ``num_devices_per_node``,
``engine_tp_size``, ``num_engines``, ``colocate`` (``true``/``false``), ``model_dir`` (the
HF folder of the initial weights and tokenizer), and one ``train_file=`` / ``val_file=``
line per data file. The scripts run it on the head node (inside the container, when there
is one) before anything else, so it first checks that what the job's steps run is there:
exit 3 naming what is missing (``dapo-megatron`` or ``ray`` not on PATH, or this python3
without the package); exit 2 for a recipe or override that does not load.

A path override that names nothing yet (a dry run's ``model.hf_config=/models/...``)
cannot be read; the recipe is then read without the path overrides (the layout does not
depend on them), with a note on stderr.
"""

from __future__ import annotations

import shutil
import sys


def main(argv: list[str]) -> int:
    missing = [f"`{name}` is not on PATH" for name in ("dapo-megatron", "ray") if shutil.which(name) is None]
    try:
        from dapo_megatron.config import PATH_KEYS, ConfigError, load_config
    except ImportError as exc:
        missing.append(f"{sys.executable} cannot import the package ({exc})")
    if missing:
        print(f"read_recipe.py: {'; '.join(missing)}", file=sys.stderr)
        return 3
    if not argv:
        print("usage: python3 read_recipe.py RECIPE [section.key=value ...]", file=sys.stderr)
        return 2
    recipe, overrides = argv[0], argv[1:]
    try:
        config = load_config(recipe, overrides)
    except ConfigError as exc:
        paths = [o for o in overrides if o.split("=", 1)[0] in PATH_KEYS]
        if not paths:
            print(f"read_recipe.py: error: {exc}", file=sys.stderr)
            return 2
        try:
            config = load_config(recipe, [o for o in overrides if o not in paths])
        except ConfigError as again:
            print(f"read_recipe.py: error: {again}", file=sys.stderr)
            return 2
        print(f"read_recipe.py: read {recipe} without its path overrides ({exc})", file=sys.stderr)
    p, r = config.parallel, config.rollout
    values = {
        "device": p.device,
        "num_nodes": p.num_nodes,
        "num_devices_per_node": p.num_devices_per_node,
        "engine_tp_size": r.engine_tp_size,
        "num_engines": r.num_engines,
        "colocate": "true" if r.colocate else "false",
        "model_dir": config.model.hf_weights_folder or "",
    }
    for name, value in values.items():
        print(f"{name}={value}")
    for name, files in (("train_file", config.data.train_files), ("val_file", config.data.val_files)):
        for file in files:
            print(f"{name}={file}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
