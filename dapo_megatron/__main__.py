"""``python -m dapo_megatron`` runs the ``dapo-megatron`` command line."""

import sys

from dapo_megatron.cli import main

sys.exit(main())
