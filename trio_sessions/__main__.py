"""`python -m trio_sessions`: the operator CLI (see `trio_sessions._cli`)."""

import sys

from ._cli import main

sys.exit(main())
