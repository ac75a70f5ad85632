"""`python -m tpudist`: the `tpudist` console script (launch, doctor)."""

import sys

from tpudist.cli import main

sys.exit(main())
