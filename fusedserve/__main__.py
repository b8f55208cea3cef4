"""`python -m fusedserve ...`: the `fusedserve` command."""

import sys

from fusedserve.cli import main

sys.exit(main())
