"""``python -m torchrl_dcp``: the ``torchrl-dcp`` command (:mod:`torchrl_dcp.cli`)."""

import sys

from torchrl_dcp.cli import main

if __name__ == "__main__":
    sys.exit(main())
