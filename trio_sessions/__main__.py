"""`python -m trio_sessions`: the operator CLI and the worker command (see `trio_sessions._cli`)."""

import sys

from ._cli import main

sys.exit(main())
