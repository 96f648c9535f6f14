#!/usr/bin/env python3
"""Convert an HF Qwen2/Qwen2.5 checkpoint to a Megatron dist checkpoint.

Same as ``dapo-megatron convert hf-to-megatron``; see tools/convert_ckpt/README.md.
"""

import sys

from dapo_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
