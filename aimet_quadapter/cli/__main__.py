"""``python -m aimet_quadapter.cli``: the same as the ``aimet-quadapter`` command."""

import sys

from aimet_quadapter.cli.app import main

sys.exit(main())
