"""``python -m longpeft.cli``: the ``longpeft`` command (the one ``accelerate launch`` starts in every process)."""

import sys

from . import main

sys.exit(main())
