"""``python -m atoll ...``: the ``atoll`` command (:func:`atoll.cli.main`), e.g. under torchrun."""

import sys

from atoll.cli import main

sys.exit(main())
