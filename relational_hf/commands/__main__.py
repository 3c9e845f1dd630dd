"""`python -m relational_hf.commands ...` is `relational-hf ...`."""

import sys

from .main import main

sys.exit(main())
