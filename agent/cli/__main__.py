"""`python -m agent.cli`: heapscope, as the installed command runs it."""

import sys

from agent.cli import main

sys.exit(main())
