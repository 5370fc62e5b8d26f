"""``python -m fastdeploy_paddlefleet.cli``: same as the ``fdfleet`` console script."""

import sys

from . import main

sys.exit(main())
