"""``python -m torchrl_asyncpool.cli``: the ``torchrl-asyncpool`` command."""
import sys

from torchrl_asyncpool.cli import main

sys.exit(main())
