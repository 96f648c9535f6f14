#!/usr/bin/env python3
"""Convert a Megatron dist checkpoint (converted or trained) back to HF safetensors.

Same as ``dapo-megatron convert megatron-to-hf``; see tools/convert_ckpt/README.md.
"""

import sys

from dapo_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
